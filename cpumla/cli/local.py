"""`cpumla list [DIR]` and `cpumla rm MODEL`: the models this machine has, and removing one.

`list` shows three kinds of model, each with how it goes away:
- the Hugging Face hub cache (cli/download.py scans it): safetensors models and GGUF quantizations,
  removed with `cpumla rm REPO`;
- the folders `cpumla quantize` wrote (a config.json whose quantization_config names cpumla's q8 / q4):
  DIR itself and the folders directly in it, DIR being the current directory unless named; removed as
  any folder is;
- the bundled presets (configs only, nothing on disk to remove), which run with --dummy-weights.

`rm` removes a whole repo from the hub cache through huggingface_hub's own deletion
(scan_cache_dir().delete_revisions of every revision it holds), after saying what that frees and asking
on a terminal; --yes skips the question, and without a terminal it is required."""

from __future__ import annotations

import json
import logging
import shutil
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import typer

from cpumla.cli import render
from cpumla.cli.download import cached_ggufs, cached_models, scan_cache
from cpumla.errors import CpumlaError
from cpumla.runtime import gguf_hub
from cpumla.runtime.gguf_hub import human_size
from cpumla.runtime.hub_cache import hf_hub_cache
from cpumla.runtime.resolve import PRESETS


@dataclass
class QuantizedFolder:
    path: Path
    fmt: str                 # q8 / q4
    model_type: str
    size: int                # bytes of the files in it


def _config(folder: Path) -> dict | None:
    try:
        d = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        return None
    return d if isinstance(d, dict) else None


def quantized_folders(root: Path) -> list[QuantizedFolder]:
    """The folders `cpumla quantize` wrote: root itself and the folders directly in it."""
    try:
        inside = sorted((p for p in root.iterdir() if p.is_dir()), key=lambda p: p.name.lower())
    except OSError as e:
        raise CpumlaError(f"{root}: cannot read the folder ({e.strerror or e})") from None
    found = []
    for d in [root, *inside]:
        cfg = _config(d)
        qc = cfg.get("quantization_config") if cfg else None
        if not isinstance(qc, dict) or qc.get("quant_method") != "cpumla":
            continue
        try:
            size = sum(f.stat().st_size for f in d.iterdir() if f.is_file())
        except OSError:
            continue
        found.append(QuantizedFolder(d, str(qc.get("format", "?")), str(cfg.get("model_type", "?")), size))
    return found


def _presets() -> list[list[str]]:
    """A row per bundled preset: name, model_type, parameters, weights as released."""
    from cpumla.runtime.plan import plan

    rows = []
    for name in PRESETS:
        p = plan(name, dummy=True)
        rows.append([name, p.model_type, f"{p.params / 1e9:.1f} B", human_size(p.weights["stored"])])
    return rows


def _hub_tables(all_models: bool) -> bool:
    """The hub cache's tables; whether it holds anything listed."""
    scanned = scan_cache()
    models = cached_models(include_all=all_models, scanned=scanned)
    ggufs = cached_ggufs(include_all=all_models, scanned=scanned)
    if not models and not ggufs:
        render.err.print(f"no DeepSeek-family models in the Hugging Face cache ({hf_hub_cache()}); "
                         f"get one with `cpumla download REPO` or `cpumla download REPO:QUANT`", markup=False,
                         highlight=False, soft_wrap=True)
        return False
    render.print_line(f"in the Hugging Face cache, {hf_hub_cache()} (`cpumla rm REPO` removes one):")
    if models:
        rows = [[m.repo_id, m.model_type, human_size(m.size_on_disk), "yes" if m.weights else "config only",
                 m.revisions] for m in models]
        render.table(None, ["model", "model_type", "size", "weights", "revisions"], rows, right={2, 4})
    if models and ggufs:
        render.out.print()
    if ggufs:
        rows = [[g.ref, g.architecture or "?", human_size(g.quant.size),
                 str(len(g.quant.shards)) if not g.quant.missing else
                 f"{len(g.quant.present)} of {len(g.quant.shards)}", str(g.snapshot / g.quant.first)] for g in ggufs]
        render.table("GGUF", ["model", "architecture", "size", "files", "path"], rows, right={2, 3})
    return True


def list_models(
    folder: str = typer.Argument(None, metavar="DIR", help="Where to look for folders written by `cpumla "
                                 "quantize`: this folder and the folders directly in it. Default: the current directory."),
    all_models: bool = typer.Option(False, "--all", metavar="",
                                    help="Every cached model, not only DeepSeek-family ones."),
) -> None:
    root = Path(folder).expanduser() if folder is not None else Path.cwd()
    if not root.is_dir():
        raise CpumlaError(f"{root}: {'not a folder' if root.exists() else 'no such folder'}")
    shown = _hub_tables(all_models)
    folders = quantized_folders(root)
    if folders:
        if shown:
            render.out.print()
        render.print_line(f"written by `cpumla quantize`, in {root} (plain folders: `rm -r FOLDER` removes one):")
        render.table(None, ["folder", "format", "model_type", "size"],
                     [[str(q.path), q.fmt, q.model_type, human_size(q.size)] for q in folders], right={3})
    if shown or folders:
        render.out.print()
    render.print_line("presets, bundled configs that run with --dummy-weights (nothing on disk to remove):")
    render.table(None, ["preset", "model_type", "parameters", "as released"], _presets(), right={2, 3})

def _find(scanned, name: str):
    """The cached model repo named `name` (exact, else in any capitalisation when only one matches), or None."""
    repos = [r for r in (scanned.repos if scanned else ()) if r.repo_type == "model"]
    exact = [r for r in repos if r.repo_id == name]
    folded = [r for r in repos if r.repo_id.casefold() == name.casefold()]
    return exact[0] if exact else folded[0] if len(folded) == 1 else None


def _not_cached(name: str) -> CpumlaError:
    why = ""
    if any(k.casefold() == name.casefold() for k in PRESETS):
        why = ": it is a bundled preset, with nothing on disk to remove"
    elif Path(name).expanduser().is_dir():
        why = ": it is a folder (remove it with rm -r)"
    return CpumlaError(f"{name} is not in the Hugging Face cache ({hf_hub_cache()}){why}; "
                       f"`cpumla list` shows what is")


def rm(
    model: str = typer.Argument(..., help="A repo id in the Hugging Face cache, as `cpumla list` shows it."),
    yes: bool = typer.Option(False, "--yes", "-y", metavar="",
                             help="Remove without asking (needed without a terminal)."),
) -> None:
    repo_id, tag = gguf_hub.parse_ref(model)
    if tag is not None:
        raise CpumlaError(f"cpumla rm removes a whole repo: `cpumla rm {repo_id}` removes {tag} and every other "
                          f"file of it")
    scanned = scan_cache()
    repo = _find(scanned, repo_id)
    if repo is None:
        raise _not_cached(repo_id)
    hashes = [r.commit_hash for r in repo.revisions]
    # the scan narrowed to this repo: a commit hash can be another repo's too (a mirror)
    strategy = replace(scanned, repos=frozenset({repo})).delete_revisions(*hashes) if hashes else None
    if strategy is not None and strategy.repos != frozenset({repo.repo_path}):
        raise CpumlaError(f"{repo.repo_id}: huggingface_hub's deletion would not remove {repo.repo_path} as a whole")
    freed = strategy.expected_freed_size if strategy is not None else repo.size_on_disk
    n = len(hashes)
    what = f"{repo.repo_id}: {human_size(freed)} in {repo.repo_path} ({n} revision{'s' if n != 1 else ''})"
    if not yes:
        if not render.is_terminal(sys.stdin):
            raise CpumlaError(f"not removing {what} without a terminal to ask on: pass --yes")
        render.print_line(what)
        if not typer.confirm(f"remove {repo.repo_id}?", default=False, err=True):
            render.err.print("nothing removed", markup=False, highlight=False)
            raise typer.Exit(1)
    hf_log = logging.getLogger("huggingface_hub")
    level = hf_log.level
    hf_log.setLevel(logging.ERROR)             # its failures are said below, in one line
    try:
        if strategy is not None:
            strategy.execute()
        else:                                  # a repo with no complete revision: only a folder to remove
            shutil.rmtree(repo.repo_path, ignore_errors=True)
    finally:
        hf_log.setLevel(level)
    if repo.repo_path.exists():
        raise CpumlaError(f"{repo.repo_path}: could not remove all of it (permissions?)")
    render.print_line(f"removed {repo.repo_id}: {human_size(freed)} freed")
