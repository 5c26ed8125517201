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

from cpumla import native
from cpumla.checkpoint.dummy import DUMMY_DTYPES, DummySource
from cpumla.checkpoint.formats import quantized_as
from cpumla.checkpoint.quant import Quantizer
from cpumla.errors import CpumlaError
from cpumla.models import PREFILL_CHUNK, family
from cpumla.runtime.engine import Engine, context_length
from cpumla.runtime.memory import check_memory
from cpumla.runtime.plan import check_fits, plan
from cpumla.runtime.resolve import load_config, open_weights


def load(model: str, *, dummy_weights: bool = False, hf_overrides=None, seed: int = 0, threads: int | None = None,
         max_seq_len: int | None = None, dummy_dtype: str = "bf16", quant: str | None = None, progress=None,
         resolved=None):
    """An Engine for `model` (a local directory, a GGUF file or a folder holding one, a Hugging Face repo
    id in the local cache, or a known repo id whose config cpumla bundles). dummy_weights: deterministic random weights from `seed` in
    the checkpoint's in-memory formats (dummy_dtype "bf16", or "fp8" as V3 ships). quant "q8" / "q4":
    quantize the linear layers as they load (checkpoint/quant.py: quant_plan says which), calling
    progress(done, total) (elements) as it goes. resolved: `model` as runtime.resolve.load_config resolved
    it for the caller (its GGUF file opened once), which the Engine then owns. Raises CpumlaError, also when
    the model cannot fit in memory (checked before anything is allocated)."""
    if threads is not None:        # quantizing runs on the pool: size it first
        native.ensure_init()
        native.set_threads(threads)
    quantizer = Quantizer(quant, progress) if quant is not None else None
    cfg, resolved = load_config(model, hf_overrides, resolved)
    fam = family(cfg.model_type)
    ctx = context_length(cfg, max_seq_len)
    where = f"preset {model}" if resolved.directory is None else str(resolved.directory)
    if resolved.gguf is not None:
        where = str(resolved.gguf.path)
    if quantizer is not None:
        if resolved.gguf is not None:
            raise CpumlaError(f"{model} is a GGUF model, stored quantized as it is: leave out --quant")
        if quantized_as(cfg):
            raise CpumlaError(f"{model} is already quantized ({quantized_as(cfg)}): leave out --quant")
        if not getattr(fam, "QUANTIZABLE", True):
            raise CpumlaError(f"--quant is not supported for {cfg.model_type} yet")
    ckpt = None
    if quantizer is not None and resolved.directory is not None and not dummy_weights:
        ckpt = open_weights(resolved)    # its headers serve both the plan and the load
    try:
        return _load(model, hf_overrides, cfg, resolved, fam, ctx, where, quantizer, ckpt, dummy_weights,
                     dummy_dtype, seed, threads)
    except BaseException:
        if ckpt is not None:
            ckpt.close()
        if resolved.gguf is not None:
            resolved.gguf.close()
        raise


def _load(model, hf_overrides, cfg, resolved, fam, ctx, where, quantizer, ckpt, dummy_weights, dummy_dtype, seed,
          threads):
    """load() past its first checks; ckpt: the checkpoint already open for a quantizing load, else None"""
    if quantizer is not None:
        # the quantized weights are made in memory: they, the caches and the scratch must fit
        check_fits(plan(model, hf_overrides, ctx, loaded=(cfg, resolved, ckpt), dummy=dummy_weights), quantizer.fmt,
                   f"{quantizer.fmt} weights")
    if dummy_weights:
        if dummy_dtype not in DUMMY_DTYPES:
            raise CpumlaError(f"dummy weight dtype must be {', '.join(DUMMY_DTYPES)}, got {dummy_dtype!r}")
        if quantizer is None:
            check_memory(fam.memory_bytes(cfg, ctx, dummy_dtype, PREFILL_CHUNK), True, where,
                         hint=lambda: plan(model, hf_overrides, ctx, dummy=True).smallest_fitting_quant())
        src = DummySource(fam.tensors(cfg), cfg.block, seed=seed, dtype=dummy_dtype)
    else:
        if resolved.directory is None:
            raise CpumlaError(f"'{model}' is a preset (config only): pass --dummy-weights, or download the "
                              f"weights with `cpumla download {model}`")
        check_memory(fam.memory_bytes(cfg, ctx, "bf16", PREFILL_CHUNK), False, where)
        src = ckpt if ckpt is not None else open_weights(resolved)
    if quantizer is not None:
        quantizer.plan_total(src, fam.tensors(cfg))
        src.quantizer = quantizer
    return Engine(fam, cfg, src, max_seq_len=ctx, threads=threads)
