"""`cpumla download REPO` and `cpumla list`: models in the Hugging Face hub cache, as cpumla uses it.

Downloads go through huggingface_hub's snapshot_download into the standard cache (HF_HOME / HF_HUB_CACHE),
so they resume after an interruption, share blobs with other tools, and honour HF_TOKEN and
HF_HUB_OFFLINE. Only what cpumla reads is fetched: no PyTorch .bin, no remote code, no MTP extras.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import typer

from cpumla.cli import render
from cpumla.errors import CpumlaError
from cpumla.runtime.resolve import hf_hub_cache

# config, generation config, tokenizer files, safetensors shards and their index
ALLOW_PATTERNS = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "*.safetensors",
    "*.safetensors.index.json",
]

DEEPSEEK_MODEL_TYPES = ("deepseek_v2", "deepseek_v3", "deepseek_v32", "deepseek_v4")


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "on", "yes", "true")


def fetch(repo_id: str, revision: str | None = None) -> Path:
    """The snapshot directory of `repo_id` in the hub cache, fetching what is missing."""
    try:
        from huggingface_hub import errors as hf_errors
        from huggingface_hub import snapshot_download
    except ImportError:
        raise CpumlaError("downloading needs the package huggingface_hub (pip install huggingface_hub)") from None
    where = f"{repo_id}" + (f" (revision {revision})" if revision else "")
    try:
        path = snapshot_download(repo_id, revision=revision, cache_dir=hf_hub_cache(), allow_patterns=ALLOW_PATTERNS,
                                 local_files_only=offline())
    except hf_errors.GatedRepoError:
        raise CpumlaError(f"{where} is gated: accept its terms on huggingface.co and set HF_TOKEN") from None
    except hf_errors.RepositoryNotFoundError:
        raise CpumlaError(f"{where}: no such repository on the Hugging Face hub (or it is private: set HF_TOKEN)") \
            from None
    except hf_errors.RevisionNotFoundError:
        raise CpumlaError(f"{where}: no such revision") from None
    except tuple(getattr(hf_errors, n) for n in ("LocalEntryNotFoundError", "OfflineModeIsEnabled")
                 if hasattr(hf_errors, n)):
        if offline():
            raise CpumlaError(f"{where} is not in the cache ({hf_hub_cache()}) and HF_HUB_OFFLINE is set") from None
        raise CpumlaError(f"{where}: cannot reach the Hugging Face hub, and the files are not cached") from None
    except hf_errors.HFValidationError as e:
        raise CpumlaError(f"'{repo_id}' is not a valid repo id: {str(e).splitlines()[0]}") from None
    except hf_errors.HfHubHTTPError as e:
        raise CpumlaError(f"{where}: {str(e).splitlines()[0]}") from None
    except OSError as e:
        raise CpumlaError(f"{where}: {e.strerror or e}") from None
    path = Path(path)
    if not (path / "config.json").is_file():
        raise CpumlaError(f"{where}: the snapshot has no config.json (not a model repository?)")
    return path


@dataclass
class CachedModel:
    repo_id: str
    model_type: str
    size_on_disk: int        # bytes, blobs shared between revisions counted once
    revisions: int
    weights: bool            # has safetensors
    snapshot: Path


def cached_models(include_all: bool = False) -> list[CachedModel]:
    """Models in the hub cache; only DeepSeek-family ones (by config.json model_type) unless include_all."""
    cache = hf_hub_cache()
    if not cache.is_dir():
        return []
    try:
        from huggingface_hub import scan_cache_dir
    except ImportError:
        raise CpumlaError("listing the cache needs the package huggingface_hub (pip install huggingface_hub)") from None
    try:
        info = scan_cache_dir(cache)
    except Exception as e:  # CacheNotFound, CorruptedCacheException
        raise CpumlaError(f"{cache}: cannot scan the cache: {e}") from None
    found = []
    for repo in info.repos:
        if repo.repo_type != "model" or not repo.revisions:
            continue
        rev = max(repo.revisions, key=lambda r: r.last_modified)
        model_type = _model_type(rev.snapshot_path / "config.json")
        if not include_all and model_type not in DEEPSEEK_MODEL_TYPES:
            continue
        weights = any(f.file_name.endswith(".safetensors") for f in rev.files)
        found.append(CachedModel(repo.repo_id, model_type or "?", repo.size_on_disk, len(repo.revisions), weights,
                                 rev.snapshot_path))
    return sorted(found, key=lambda m: m.repo_id.lower())


def _model_type(path: Path) -> str | None:
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return d.get("model_type") if isinstance(d, dict) else None


def human_size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n} B"


def download(
    repo: str = typer.Argument(..., help="A Hugging Face repo id, e.g. deepseek-ai/DeepSeek-V2-Lite-Chat."),
    revision: str = typer.Option(None, "--revision", "-r", help="A branch, tag or commit. Default: main."),
) -> None:
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
    models = cached_models(include_all=all_models)
    if not models:
        render.err.print(f"no DeepSeek-family models in the Hugging Face cache ({hf_hub_cache()}); "
                         f"get one with `cpumla download REPO`", markup=False, highlight=False, soft_wrap=True)
        return
    rows = [[m.repo_id, m.model_type, human_size(m.size_on_disk), "yes" if m.weights else "config only",
             m.revisions] for m in models]
    render.table(None, ["model", "model_type", "size", "weights", "revisions"], rows, right={2, 4})
