"""`cpumla download REPO` and `cpumla list`: the Hugging Face cache, as cpumla uses it."""

from __future__ import annotations

import typer

from cpumla.cli import render


def download(
    repo: str = typer.Argument(..., help="A Hugging Face repo id, e.g. deepseek-ai/DeepSeek-V2-Lite-Chat."),
    revision: str = typer.Option(None, "--revision", "-r", help="A branch, tag or commit. Default: main."),
) -> None:
    from cpumla.runtime.download import ALLOW_PATTERNS, download as fetch, human_size, offline
    from cpumla.runtime.resolve import hf_hub_cache

    if not offline():
        render.err.print(f"downloading {repo} ({', '.join(ALLOW_PATTERNS)}) into {hf_hub_cache()}",
                         style="dim", markup=False, highlight=False, soft_wrap=True)
    path = fetch(repo, revision=revision)
    size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    render.out.print(f"{repo}: {human_size(size)} in {path}", markup=False, highlight=False, soft_wrap=True)
    render.err.print(f"run it with: cpumla chat {repo}", style="dim", markup=False, highlight=False)


def list_models(
    all_models: bool = typer.Option(False, "--all", help="Every cached model, not only DeepSeek-family ones."),
) -> None:
    from cpumla.runtime.download import cached_models, human_size
    from cpumla.runtime.resolve import hf_hub_cache

    models = cached_models(include_all=all_models)
    if not models:
        render.err.print(f"no DeepSeek-family models in the Hugging Face cache ({hf_hub_cache()}); "
                         f"get one with `cpumla download REPO`", markup=False, highlight=False, soft_wrap=True)
        return
    rows = [[m.repo_id, m.model_type, human_size(m.size_on_disk), "yes" if m.weights else "config only",
             m.revisions] for m in models]
    render.table(None, ["model", "model_type", "size", "weights", "revisions"], rows, right={2, 4})
