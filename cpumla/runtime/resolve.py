"""Turn a `--model` argument into a config (and, when the weights are here, a directory).

Order: a local directory (or a GGUF file, a folder holding one, a split set's shard), then a repo id already in the local Hugging Face cache, then a known
preset (config only, no weights). Nothing here touches the network: the cache lookup is a purely
local read, whatever HF_HUB_OFFLINE says, and downloading is `cpumla download`'s job.
"""

from __future__ import annotations

import copy
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from cpumla.checkpoint.gguf_model import GGUFCheckpoint
from cpumla.checkpoint.jsonfile import check_depth, read_json_object
from cpumla.checkpoint.safetensors import Checkpoint
from cpumla.errors import CpumlaError
from cpumla.models import config_from_dict, family
from cpumla.models.presets import DIR as PRESET_DIR
from cpumla.runtime import gguf_hub
from cpumla.runtime.hub_cache import hf_hub_cache, hf_home

# repo id -> preset config.json; file "<org>--<name>.json" holds repo "<org>/<name>".
PRESETS: dict[str, Path] = {
    p.stem.replace("--", "/", 1): p for p in sorted(PRESET_DIR.glob("*.json"))
}

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")


@dataclass
class Resolved:
    kind: Literal["dir", "cache", "preset", "gguf"]
    directory: Path | None  # holds config.json and the weights (or the GGUF file); None for a preset
    repo_id: str | None  # None for a plain local directory
    config: dict[str, Any]  # config.json contents (or the preset's, or the one a GGUF's metadata gives)
    gguf: GGUFCheckpoint | None = None  # a GGUF model, open (its metadata gave the config)

    @property
    def name(self) -> str:
        """The model's name: its repo id (a preset's included), else its directory's name."""
        return self.repo_id or (self.directory.name if self.directory else "")

    @property
    def source(self) -> str:
        """Where the config came from, for messages."""
        if self.gguf is not None:
            return str(self.gguf.path)
        return str(self.directory / "config.json") if self.directory else f"preset {self.repo_id}"


def open_weights(resolved: Resolved):
    """The weight source of a resolved model with weights: its GGUF file, or its safetensors Checkpoint."""
    return resolved.gguf if resolved.gguf is not None else Checkpoint(resolved.directory)


def _gguf(path: Path, mtp=None) -> Resolved:
    g = GGUFCheckpoint(path, mtp)
    return Resolved("gguf", g.path.parent, None, g.config, g)


def _preset_key(repo_id: str) -> str | None:
    """Hub repo ids are case-insensitive: accept any spelling, return ours."""
    folded = repo_id.casefold()
    return next((k for k in PRESETS if k.casefold() == folded), None)


def preset_config(repo_id: str) -> dict[str, Any]:
    key = _preset_key(repo_id)
    if key is None:
        raise CpumlaError(f"'{repo_id}' is not a known preset (presets: {', '.join(PRESETS)})")
    return read_json_object(PRESETS[key])


def _cached_snapshot(repo_id: str, revision: str | None = None) -> Path | None:
    """The snapshot directory of `repo_id` in the local hub cache if it has config.json, else None."""
    cache = hf_hub_cache()
    try:
        from huggingface_hub import try_to_load_from_cache  # local files only, never the network
    except ImportError:
        try_to_load_from_cache = None
    if try_to_load_from_cache is not None:
        try:
            found = try_to_load_from_cache(repo_id, "config.json", cache_dir=cache, revision=revision)
        except Exception:  # invalid repo id, unreadable cache: treat as "not cached"
            return None
        return Path(found).parent if isinstance(found, (str, os.PathLike)) else None
    # Same layout by hand: models--org--name/refs/<rev> holds the commit of snapshots/<commit>/.
    repo_dir = cache / ("models--" + repo_id.replace("/", "--"))
    rev = revision or "main"
    ref = repo_dir / "refs" / rev
    commit = ref.read_text().strip() if ref.is_file() else rev
    snapshot = repo_dir / "snapshots" / commit
    return snapshot if (snapshot / "config.json").is_file() else None


def _looks_like_path(model: str) -> bool:
    return model.startswith(("/", ".", "~")) or os.sep in model.replace("/", "") or model.count("/") > 1


def resolve_model(model: str, mtp=None) -> Resolved:
    """mtp: a GGUF model's MTP source (GGUFCheckpoint's mtp; runtime/speculative.py: mtp_source); a path
    there is refused for any other model."""
    got = _resolve(model, mtp)
    if mtp not in (None, False) and got.gguf is None:
        raise CpumlaError(f"--draft-model {mtp}: an MTP file drafts for a GGUF model; {model} is not one")
    return got


def _resolve(model: str, mtp) -> Resolved:
    path = Path(model).expanduser()
    if path.is_dir():
        config_path = path / "config.json"
        if not config_path.is_file():
            if any(path.glob("*.gguf")):
                return _gguf(path.resolve(), mtp)
            raise CpumlaError(f"{path}: has no config.json (is it a model directory?)")
        return Resolved("dir", path.resolve(), None, read_json_object(config_path))
    if path.exists():
        if path.suffix == ".gguf":
            return _gguf(path.absolute(), mtp)    # not resolved: a link in the hub cache keeps its shard name
        raise CpumlaError(f"{path}: is a file; --model wants a model directory, a .gguf file or a repo id")
    if gguf_hub.is_ref(model):           # REPO:QUANT, a GGUF quantization in the hub cache
        return _gguf(gguf_hub.cached_path(model), mtp)
    if _looks_like_path(model):
        raise CpumlaError(f"{path}: no such directory")

    if _REPO_ID.match(model):
        snapshot = _cached_snapshot(model)
        if snapshot is not None:
            return Resolved("cache", snapshot, model, read_json_object(snapshot / "config.json"))
        key = _preset_key(model)
        if key is not None:
            return Resolved("preset", None, key, read_json_object(PRESETS[key]))

    raise CpumlaError(
        f"'{model}' is not a local directory, not in the Hugging Face cache (HF_HOME={hf_home()}), "
        f"and not a known preset; download it with `cpumla download {model}` "
        f"(presets: {', '.join(PRESETS)})")


def _merge(base: dict[str, Any], patch: dict[str, Any], where: str) -> None:
    for key, value in patch.items():
        if key not in base and not where:
            raise CpumlaError(f"--hf-overrides: config has no field '{key}'")
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _merge(base[key], value, f"{where}{key}.")  # e.g. rope_scaling: key-wise
        else:
            base[key] = copy.deepcopy(value)


def apply_overrides(config: dict[str, Any], overrides: dict[str, Any] | None) -> dict[str, Any]:
    """vLLM-style hf_overrides: merge a dict into a copy of `config`.

    Top-level keys must already exist in the config (a typo is an error, not a silent no-op);
    nested objects such as rope_scaling merge key by key and may gain keys.
    """
    merged = copy.deepcopy(config)
    _merge(merged, check_overrides(overrides), "")
    return merged


def check_overrides(overrides: dict[str, Any] | None) -> dict[str, Any]:
    """hf_overrides as the library takes it: a dict or None ({}). JSON text is the CLI's to parse
    (cpumla.cli.overrides.parse_hf_overrides); anything else is a CpumlaError."""
    if overrides is None:
        return {}
    if isinstance(overrides, str):
        raise CpumlaError("hf_overrides must be a dict, not a str (the CLI parses JSON)")
    if not isinstance(overrides, dict):
        raise CpumlaError(f"hf_overrides must be a dict, not a {type(overrides).__name__}")
    check_depth(overrides, "hf_overrides")
    return overrides


def load_config(model: str, hf_overrides=None, resolved: Resolved | None = None, mtp=None):
    """(family config, Resolved) for a local directory, a cached repo id or a preset. resolved: `model`
    resolved already (a GGUF file open once, not parsed again), its config taken under hf_overrides.
    mtp: where a GGUF model's MTP layer comes from (resolve_model)."""
    if resolved is None:
        resolved = resolve_model(model, mtp)
    where = resolved.source if resolved.kind != "preset" else f"preset {model}"
    cfg_dict = apply_overrides(resolved.config, hf_overrides)
    fit = getattr(family(cfg_dict.get("model_type"), where), "fit_overrides", None)
    if fit is not None:
        cfg_dict = fit(cfg_dict, check_overrides(hf_overrides))
    return config_from_dict(cfg_dict, source=where), resolved
