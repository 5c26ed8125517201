"""`cpumla download REPO`, and the hub cache as `cpumla list` and `cpumla rm` read it (cli/local.py).

Downloads go through huggingface_hub's snapshot_download into the standard cache (HF_HOME / HF_HUB_CACHE),
so they resume after an interruption, share blobs with other tools, and honour HF_TOKEN and
HF_HUB_OFFLINE. Only what cpumla reads is fetched: no PyTorch .bin, no remote code, no MTP extras.

`REPO:QUANT` fetches one GGUF quantization (runtime/gguf_hub.py names them): the repo's file list
and sizes come first (HfApi.model_info), then only that model's files, every shard of a split set. A
repo of GGUF models alone, named without a quantization, gets its quantizations listed and exit 2.
With HF_HUB_OFFLINE the cache's snapshot stands in for the hub's list."""

from __future__ import annotations

import json
import os
import re
import shutil
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import typer

from cpumla.runtime import gguf_hub
from cpumla.cli import render
from cpumla.errors import CpumlaError
from cpumla.runtime.gguf_hub import choose, complete, human_size
from cpumla.runtime.hub_cache import hf_hub_cache

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


def _where(repo_id: str, revision: str | None) -> str:
    return repo_id + (f" (revision {revision})" if revision else "")


@contextmanager
def hub_errors(repo_id: str, revision: str | None = None):
    """The hub's failures as one CpumlaError line naming the repo."""
    from huggingface_hub import errors as hf_errors

    where = _where(repo_id, revision)

    try:
        yield
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
    except Exception as e:            # the HTTP client's own (a refused connection, a timeout)
        if type(e).__module__.split(".")[0] not in ("httpx", "httpx2", "requests", "urllib3"):
            raise
        raise CpumlaError(f"{where}: cannot reach the Hugging Face hub ({type(e).__name__})") from None


def _hub():
    try:
        import huggingface_hub
    except ImportError:
        raise CpumlaError("downloading needs the package huggingface_hub (pip install huggingface_hub)") from None
    return huggingface_hub


def fetch(repo_id: str, revision: str | None = None, allow_patterns=None, want_config: bool = True) -> Path:
    """The snapshot directory of `repo_id` in the hub cache, fetching what is missing (allow_patterns:
    which files, ALLOW_PATTERNS by default)."""
    hub = _hub()
    with hub_errors(repo_id, revision):
        path = hub.snapshot_download(repo_id, revision=revision, cache_dir=hf_hub_cache(),
                                     allow_patterns=allow_patterns or ALLOW_PATTERNS, local_files_only=offline())
    path = Path(path)
    if want_config and not (path / "config.json").is_file():
        raise CpumlaError(f"{_where(repo_id, revision)}: the snapshot has no config.json (not a model repository?)")
    return path


def remote_files(repo_id: str, revision: str | None = None) -> dict[str, int | None]:
    """The files of a repo on the hub: {path: bytes}."""
    hub = _hub()
    with hub_errors(repo_id, revision):
        info = hub.HfApi().model_info(repo_id, revision=revision, files_metadata=True)
    return {s.rfilename: s.size for s in info.siblings or []}


@dataclass
class CachedModel:
    repo_id: str
    model_type: str
    size_on_disk: int        # bytes, blobs shared between revisions counted once
    revisions: int
    weights: bool            # has safetensors
    snapshot: Path


def scan_cache():
    """huggingface_hub's scan of the hub cache, or None when there is no cache."""
    cache = hf_hub_cache()
    if not cache.is_dir():
        return None
    try:
        from huggingface_hub import scan_cache_dir
    except ImportError:
        raise CpumlaError("listing the cache needs the package huggingface_hub (pip install huggingface_hub)") from None
    try:
        return scan_cache_dir(cache)
    except Exception as e:  # CacheNotFound, CorruptedCacheException
        raise CpumlaError(f"{cache}: cannot scan the cache: {e}") from None


def _latest(repo):
    return max(repo.revisions, key=lambda r: r.last_modified)


def cached_models(include_all: bool = False, scanned=None) -> list[CachedModel]:
    """Models in the hub cache; only DeepSeek-family ones (by config.json model_type) unless include_all."""
    info = scanned or scan_cache()
    found = []
    for repo in info.repos if info else ():
        if repo.repo_type != "model" or not repo.revisions:
            continue
        rev = _latest(repo)
        model_type = _model_type(rev.snapshot_path / "config.json")
        if not include_all and model_type not in DEEPSEEK_MODEL_TYPES:
            continue
        weights = any(f.file_name.endswith(".safetensors") for f in rev.files)
        found.append(CachedModel(repo.repo_id, model_type or "?", repo.size_on_disk, len(repo.revisions), weights,
                                 rev.snapshot_path))
    return sorted(found, key=lambda m: m.repo_id.lower())


@dataclass
class CachedGGUF:
    repo_id: str
    quant: gguf_hub.Quant
    snapshot: Path
    architecture: str | None     # from the first file's header (None: not there or not readable)

    @property
    def ref(self) -> str:
        return f"{self.repo_id}:{self.quant.name}"


def cached_ggufs(include_all: bool = False, scanned=None) -> list[CachedGGUF]:
    """The GGUF models in the hub cache (each repo's newest snapshot). Unless include_all, only those of
    an architecture cpumla runs (and split sets whose first file is missing, which cannot tell)."""
    from cpumla.checkpoint.gguf_info import architecture
    from cpumla.checkpoint.gguf_meta import ARCHES

    info = scanned or scan_cache()
    found = []
    for repo in info.repos if info else ():
        if repo.repo_type != "model" or not repo.revisions:
            continue
        rev = _latest(repo)
        files = {f.file_path.relative_to(rev.snapshot_path).as_posix(): f.size_on_disk for f in rev.files
                 if f.file_name.lower().endswith(".gguf")}
        for q in gguf_hub.quants(files):
            arch = architecture(rev.snapshot_path / q.first) if q.first in q.sizes else None
            if include_all or arch in ARCHES or (arch is None and q.missing):
                found.append(CachedGGUF(repo.repo_id, q, rev.snapshot_path, arch))
    return sorted(found, key=lambda g: (g.repo_id.lower(), g.quant.size))


def _model_type(path: Path) -> str | None:
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return d.get("model_type") if isinstance(d, dict) else None


def _literal(path: str) -> str:
    """A file path as an fnmatch pattern that matches only itself."""
    return re.sub(r"([*?\[])", r"[\1]", path)


def _free_space(path: Path) -> int | None:
    for p in (path, *path.parents):
        if p.is_dir():
            try:
                return shutil.disk_usage(p).free
            except OSError:
                return None
    return None


def download_gguf(repo_id: str, tag: str, revision: str | None) -> None:
    """REPO:QUANT: that quantization's files (every shard), and the MTP file beside them when the repo has
    one (gguf_hub.mtp_of), into the hub cache."""
    where = _where(repo_id, revision)
    if offline():
        snap = gguf_hub.snapshot(repo_id, revision)
        if snap is None:
            raise CpumlaError(f"{where} is not in the cache ({hf_hub_cache()}) and HF_HUB_OFFLINE is set")
        q = choose(f"{where} in the cache", tag, gguf_hub.quants(gguf_hub.cached_files(snap)))
        first = complete(f"{repo_id}:{q.name}", snap, q, "HF_HUB_OFFLINE is set")
    else:
        files = remote_files(repo_id, revision)
        q = choose(where, tag, gguf_hub.quants(files))
        if q.missing:
            raise CpumlaError(f"{where}: {q.name} is a split set of {len(q.shards)} files, but the repo lacks "
                              f"{', '.join(q.missing)}")
        mtp = gguf_hub.mtp_of(files, q)        # its MTP layer in a file of its own (a whole one), fetched with it
        if mtp is not None and mtp.missing:
            mtp = None
        shards = q.shards + (mtp.shards if mtp is not None else [])
        size = q.size + (mtp.size if mtp is not None else 0)
        n = f"{len(shards)} files" if len(shards) > 1 else "1 file"
        with_mtp = f", its MTP layer in {mtp.first}" if mtp is not None else ""
        render.err.print(f"downloading {repo_id}:{q.name} ({n}, {human_size(size)}{with_mtp}) into {hf_hub_cache()}",
                         style="dim", markup=False, highlight=False, soft_wrap=True)
        free = _free_space(hf_hub_cache())
        if free is not None and free < size:
            render.print_warning(f"{human_size(free)} free where the cache is, less than {human_size(size)} "
                                 f"(less is needed when part of it is cached already)")
        snap = fetch(repo_id, revision, allow_patterns=[_literal(s) for s in shards], want_config=False)
        first = complete(f"{repo_id}:{q.name}", snap, q, "the download did not finish: run it again")
        if mtp is not None:
            complete(f"{repo_id}:{mtp.first}", snap, mtp, "the download did not finish: run it again")
    size = sum((snap / s).stat().st_size for s in q.shards)
    render.out.print(f"{repo_id}:{q.name}: {human_size(size)} in {first}", markup=False, highlight=False,
                     soft_wrap=True)
    render.err.print(f"run it with: cpumla chat {first}", style="dim", markup=False, highlight=False, soft_wrap=True)


def _refuse_gguf_only(repo_id: str, revision: str | None) -> None:
    """A repo of GGUF models and no safetensors: its quantizations listed, and a CpumlaError asking for one."""
    if offline():
        snap = gguf_hub.snapshot(repo_id, revision)
        if snap is None or any(snap.rglob("*.safetensors")):
            return
        files = gguf_hub.cached_files(snap)
    else:
        files = remote_files(repo_id, revision)
        if any(f.endswith(".safetensors") for f in files):
            return
    found = gguf_hub.quants(files)
    if not found:
        return
    render.table(f"{repo_id}: GGUF models", ["quantization", "files", "size", "path"],
                 [[q.name, len(q.shards), human_size(q.size), q.first] for q in found], right={1, 2})
    pick = next((q.name for q in found if q.name.upper() == "Q4_K_M"), found[0].name)
    raise CpumlaError(f"{repo_id} holds GGUF models only: name a quantization, e.g. "
                      f"cpumla download {repo_id}:{pick}")


def download(
    repo: str = typer.Argument(..., help="A Hugging Face repo id, e.g. deepseek-ai/DeepSeek-V2-Lite-Chat; "
                                         "REPO:QUANT for one GGUF quantization, e.g. unsloth/DeepSeek-V3-GGUF:Q4_K_M."),
    revision: str = typer.Option(None, "--revision", "-r", help="A branch, tag or commit. Default: main."),
) -> None:
    repo, tag = gguf_hub.parse_ref(repo)
    if tag is not None:
        return download_gguf(repo, tag, revision)
    _refuse_gguf_only(repo, revision)
    if not offline():
        render.err.print(f"downloading {repo} ({', '.join(ALLOW_PATTERNS)}) into {hf_hub_cache()}",
                         style="dim", markup=False, highlight=False, soft_wrap=True)
    path = fetch(repo, revision=revision)
    size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    render.out.print(f"{repo}: {human_size(size)} in {path}", markup=False, highlight=False, soft_wrap=True)
    render.err.print(f"run it with: cpumla chat {repo}", style="dim", markup=False, highlight=False)

