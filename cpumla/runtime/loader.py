"""cpumla.load(): model argument -> config (+ overrides) -> memory check -> weights (checkpoint or
dummy) -> Engine.

Memory: before anything is allocated, the family's byte count (weights, caches, scratch: from the
config alone) is compared with the memory this process may still use: MemAvailable, and the cgroup's
limit less its usage (cgroup v2 or v1). Memory that must be anonymous (caches, scratch, and dummy
weights, which are generated in memory) has to fit, else one CpumlaError line naming both numbers. A
checkpoint's weights are memory-mapped from its files and count against nothing: as with llama.cpp's
mmap, a model larger than RAM still loads, and runs from the page cache (slowly, as pages are read
back from disk).
"""

from __future__ import annotations

import os
from pathlib import Path

from cpumla.errors import CpumlaError
from cpumla.models import config_from_dict, family

GIB = 1 << 30
DUMMY_DTYPES = ("bf16", "fp8", "f32")


def load_config(model: str, hf_overrides=None):
    """(family config, Resolved) for a local directory, a cached repo id or a preset."""
    from cpumla.runtime.resolve import apply_overrides, check_overrides, resolve_model

    resolved = resolve_model(model)
    where = f"{resolved.directory / 'config.json'}" if resolved.directory else f"preset {model}"
    cfg_dict = apply_overrides(resolved.config, hf_overrides)
    fit = getattr(family(cfg_dict.get("model_type"), where), "fit_overrides", None)
    if fit is not None:
        cfg_dict = fit(cfg_dict, check_overrides(hf_overrides))
    return config_from_dict(cfg_dict, source=where), resolved


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return int(text) if text.isdigit() else None     # "max" (no limit) and unreadable files: None


def _stat_value(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) >= 2 and parts[0] == key and parts[1].isdigit():
                return int(parts[1])
    except (OSError, UnicodeDecodeError):
        pass
    return 0


def _cgroup_room(proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = Path("/sys/fs/cgroup")):
    """(bytes the cgroup lets this process still use, its directory) for the tightest limit on the
    way up from this process's cgroup (v2 memory.max, or v1 memory.limit_in_bytes); reclaimable
    file pages count as free. None without a limit."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    best = None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":                              # v2
            base = root if (root / "cgroup.controllers").exists() or not (root / "unified").is_dir() \
                else root / "unified"                                       # hybrid hierarchy
            files = ("memory.max", "memory.current", "memory.stat", "inactive_file")
        elif "memory" in parts[1].split(","):                               # v1
            base, files = root / "memory", ("memory.limit_in_bytes", "memory.usage_in_bytes", "memory.stat",
                                            "total_inactive_file")
        else:
            continue
        d = base / parts[2].lstrip("/")
        while True:
            limit = _read_int(d / files[0])
            if limit is not None and limit < 1 << 60:                      # v1 "no limit" is ~2^63
                used = _read_int(d / files[1]) or 0
                room = max(0, limit - used + _stat_value(d / files[2], files[3]))
                if best is None or room < best[0]:
                    best = (room, d)
            if d == base or base not in d.parents:
                break
            d = d.parent
    return best


def available_memory() -> tuple[int, str]:
    """(bytes this process can still allocate, where that number comes from). The environment variable
    CPUMLA_MEMORY_AVAILABLE (bytes) replaces the measurement: a test hook."""
    forced = os.environ.get("CPUMLA_MEMORY_AVAILABLE", "").strip()
    if forced:
        if not forced.isdigit():
            raise CpumlaError(f"CPUMLA_MEMORY_AVAILABLE must be a byte count, got {forced!r}")
        return int(forced), "CPUMLA_MEMORY_AVAILABLE"
    avail, what = None, "unknown"
    v = _stat_value(Path("/proc/meminfo"), "MemAvailable:")
    if v:
        avail, what = v * 1024, "MemAvailable"
    cg = _cgroup_room()
    if cg is not None and (avail is None or cg[0] < avail):
        avail, what = cg[0], f"cgroup limit of {cg[1]}"
    return (avail if avail is not None else 1 << 62), what


def gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB" if n < 1 << 50 else f"{n:.3g} bytes"


def check_memory(need: dict[str, int], dummy: bool, where: str, hint=None) -> None:
    """Refuses (CpumlaError) when the anonymous memory a model needs exceeds what is available.
    hint(): the --quant that would fit, or None (asked only when refusing)."""
    anon = need["cache"] + need["scratch"] + (need["weights"] if dummy else 0)
    avail, what = available_memory()
    if anon > avail:
        parts = (f"weights {gib(need['weights'])}, " if dummy else "") + \
            f"caches {gib(need['cache'])}, scratch {gib(need['scratch'])}"
        q = hint() if hint is not None else None
        raise CpumlaError(f"{where}: needs {gib(anon)} of memory ({parts}) but {gib(avail)} is available "
                          f"({what}); " + (f"--quant {q} would fit" if q else
                                           "use a smaller --ctx / max_seq_len or a smaller model"))


def load(model: str, *, dummy_weights: bool = False, hf_overrides=None, seed: int = 0, threads: int | None = None,
         max_seq_len: int | None = None, dummy_dtype: str = "bf16", quant: str | None = None, progress=None):
    """An Engine for `model` (a local directory, a Hugging Face repo id in the local cache, or a known
    repo id whose config cpumla bundles). dummy_weights: deterministic random weights from `seed` in
    the checkpoint's in-memory formats (dummy_dtype "bf16", or "fp8" as V3 ships). quant "q8" / "q4":
    quantize the linear layers as they load (runtime/weights.py: quant_plan says which), calling
    progress(done, total) (elements) as it goes. Raises CpumlaError, also when the model cannot fit in
    memory (checked before anything is allocated)."""
    from cpumla import native
    from cpumla.runtime.engine import context_length
    from cpumla.runtime.weights import Quantizer, quantized_as

    if threads is not None:        # quantizing runs on the pool: size it first
        native.ensure_init()
        native.set_threads(threads)
    quantizer = Quantizer(quant, progress) if quant is not None else None
    cfg, resolved = load_config(model, hf_overrides)
    fam = family(cfg.model_type)
    ctx = context_length(cfg, max_seq_len)
    where = f"preset {model}" if resolved.directory is None else str(resolved.directory)
    if quantizer is not None:
        if quantized_as(cfg):
            raise CpumlaError(f"{model} is already quantized ({quantized_as(cfg)}): leave out --quant")
        if not getattr(fam, "QUANTIZABLE", True):
            raise CpumlaError(f"--quant is not supported for {cfg.model_type} yet")
    ckpt = None
    if quantizer is not None and resolved.directory is not None and not dummy_weights:
        from cpumla.runtime.safetensors import Checkpoint

        ckpt = Checkpoint(resolved.directory)    # its headers serve both the plan and the load
    try:
        return _load(model, hf_overrides, cfg, resolved, fam, ctx, where, quantizer, ckpt, dummy_weights,
                     dummy_dtype, seed, threads)
    except BaseException:
        if ckpt is not None:
            ckpt.close()
        raise


def _load(model, hf_overrides, cfg, resolved, fam, ctx, where, quantizer, ckpt, dummy_weights, dummy_dtype, seed,
          threads):
    """load() past its first checks; ckpt: the checkpoint already open for a quantizing load, else None"""
    from cpumla.runtime.engine import PREFILL_CHUNK, Engine
    from cpumla.runtime.plan import check_fits, plan
    from cpumla.runtime.weights import DummySource

    if quantizer is not None:
        # the quantized weights are made in memory: they, the caches and the scratch must fit
        check_fits(plan(model, hf_overrides, ctx, loaded=(cfg, resolved, ckpt)), quantizer.fmt,
                   f"{quantizer.fmt} weights")
    if dummy_weights:
        if dummy_dtype not in DUMMY_DTYPES:
            raise CpumlaError(f"dummy weight dtype must be {', '.join(DUMMY_DTYPES)}, got {dummy_dtype!r}")
        if quantizer is None:
            check_memory(fam.memory_bytes(cfg, ctx, dummy_dtype, PREFILL_CHUNK), True, where,
                         hint=lambda: plan(model, hf_overrides, ctx).smallest_fitting_quant())
        src = DummySource(fam.tensors(cfg), cfg.block, seed=seed, dtype=dummy_dtype)
    else:
        if resolved.directory is None:
            raise CpumlaError(f"'{model}' is a preset (config only): pass --dummy-weights, or download the "
                              f"weights with `cpumla download {model}`")
        from cpumla.runtime.safetensors import Checkpoint

        check_memory(fam.memory_bytes(cfg, ctx, "bf16", PREFILL_CHUNK), False, where)
        src = ckpt if ckpt is not None else Checkpoint(resolved.directory)
    if quantizer is not None:
        quantizer.plan_total(src, fam.tensors(cfg))
        src.quantizer = quantizer
    return Engine(fam, cfg, src, max_seq_len=ctx, threads=threads)
