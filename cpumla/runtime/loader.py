"""cpumla.load(): model argument -> config (+ overrides) -> memory check -> weights (checkpoint or
dummy) -> Engine.

Memory: before anything is allocated, the family's byte count (weights, caches, scratch: from the
config alone) is compared with the memory this process may still use: MemAvailable, and the cgroup's
limit less its usage (cgroup v2 or v1). Memory that must be anonymous (caches, scratch, and dummy
weights, which are generated in memory) has to fit, else one CpumlaError line naming both numbers. A
checkpoint's weights are memory-mapped from its files. When they, the caches and the scratch fit the
budget (`memory`, by default that same measure), they run mapped, from the page cache; when they do
not, the routed experts stay on disk and are read as tokens route to them, into slots of what the
budget leaves (runtime/streaming.py).
"""

from __future__ import annotations

from cpumla import native
from cpumla.checkpoint.dummy import DUMMY_DTYPES, DummySource
from cpumla.checkpoint.formats import quantized_as
from cpumla.checkpoint.quant import Quantizer
from cpumla.errors import CpumlaError
from cpumla.models import PREFILL_CHUNK, family
from cpumla.runtime import speculative, streaming
from cpumla.runtime import tp as tp_mod
from cpumla.runtime.engine import Engine, context_length
from cpumla.runtime.memory import check_memory
from cpumla.runtime.plan import check_fits, plan
from cpumla.runtime.resolve import load_config, open_weights
from cpumla.runtime.text import Text


def load(model: str, *, dummy_weights: bool = False, hf_overrides=None, seed: int = 0, threads: int | None = None,
         max_seq_len: int | None = None, dummy_dtype: str = "bf16", quant: str | None = None, progress=None,
         resolved=None, memory: int | None = None, expert_slots: int | None = None, expert_policy: str = "lru",
         tokenizer: str | None = None, draft: str | None = None, draft_tokens: int = 1,
         draft_p_min: float | None = None, draft_model: str | None = None, tp: int | None = None):
    """An Engine for `model` (a local directory, a GGUF file or a folder holding one, a Hugging Face repo
    id in the local cache, or a known repo id whose config cpumla bundles). dummy_weights: deterministic random weights from `seed` in
    the checkpoint's in-memory formats (dummy_dtype "bf16", or "fp8" as V3 ships). quant "q8" / "q4":
    quantize the linear layers as they load (checkpoint/quant.py: quant_plan says which), calling
    progress(done, total) (elements) as it goes. resolved: `model` as runtime.resolve.load_config resolved
    it for the caller (its GGUF file opened once), which the Engine then owns. memory: the budget in bytes
    (default: what the process may use); a checkpoint whose weights, caches and scratch exceed it keeps
    its routed experts on disk and reads those a token uses into slots (runtime/streaming.py).
    expert_slots: that many slots, whatever the budget (streaming even when all would fit); expert_policy:
    which slot an expert replaces, "lru" or "lfu". tokenizer: the text API's (Engine.chat / complete), as
    `cpumla chat --tokenizer` takes it (default: the model's own). draft, draft_tokens, draft_p_min:
    speculative decoding (Engine.set_draft; default: the checkpoint's MTP layer where it has one, one
    draft token); draft_model: a GGUF model's MTP file, where it is not beside the model as `mtp-` + the
    model's file name (with draft "ngram" or "none" no MTP file is opened). tp: that many tensor-parallel
    ranks, started here as processes of their own (runtime/tp.py; under torchrun the launch's ranks are
    joined whatever tp says); ranks other than 0 never return. Raises CpumlaError, also when the model
    cannot fit in memory (checked before anything is allocated)."""
    if memory is not None and (isinstance(memory, bool) or not isinstance(memory, int) or memory < 1):
        raise CpumlaError(f"memory must be a positive number of bytes, got {memory!r}")
    if expert_slots is not None and (isinstance(expert_slots, bool) or not isinstance(expert_slots, int)
                                     or expert_slots < 1):
        raise CpumlaError(f"expert_slots must be a positive integer, got {expert_slots!r}")
    speculative.check_draft(draft, draft_tokens, draft_p_min)
    mtp = speculative.mtp_source(draft, draft_model)
    tp = tp_mod.default_tp(tp)
    load_args = {k: v for k, v in locals().items() if k not in ("progress", "resolved", "tp", "mtp")}
    if threads is not None:        # quantizing runs on the pool: size it first
        native.ensure_init()
        native.set_threads(threads)
    quantizer = Quantizer(quant, progress) if quant is not None else None
    cfg, resolved = load_config(model, hf_overrides, resolved, mtp)
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
    ranks = None
    if tp not in (None, 1) or tp_mod.launch_world() > 1:
        if not getattr(fam.Model, "TENSOR_PARALLEL", False):
            raise CpumlaError(f"tensor-parallel ranks do not run {cfg.model_type} yet")
        ranks = tp_mod.start(tp, load_args)
        if ranks is not None and threads is None:
            threads = tp_mod.threads_per_rank(1)           # this rank's CPUs (start() pinned it)
            native.ensure_init()
            native.set_threads(threads)
    ckpt = None
    if quantizer is not None and resolved.directory is not None and not dummy_weights:
        ckpt = open_weights(resolved)    # its headers serve both the plan and the load
    try:
        engine = _load(model, hf_overrides, cfg, resolved, fam, ctx, where, quantizer, ckpt, dummy_weights,
                       dummy_dtype, seed, threads, (memory, expert_slots, expert_policy), ranks)
        if ranks is not None:
            _join(engine, ranks, cfg, resolved, load_args)
        engine.text = Text(model, resolved, dummy_weights, tokenizer)
        try:
            engine.set_draft(draft, draft_tokens, draft_p_min)
        except CpumlaError:
            engine.close()
            raise
        return engine
    except BaseException as e:
        if ranks is not None:
            _fail(ranks, e)
        if ckpt is not None:
            ckpt.close()
        if resolved.gguf is not None:
            resolved.gguf.close()
        raise


def _join(engine, ranks, cfg, resolved, load_args) -> None:
    """The ranks agree (or all fail), connect; rank 0's model becomes a tp.Leader, the others follow."""
    options = {k: load_args[k] for k in ("dummy_weights", "hf_overrides", "seed", "max_seq_len", "dummy_dtype", "quant")}
    ranks.agree(("ok", tp_mod.fingerprint(cfg, resolved, options | {"world": ranks.world})))
    engine.model.attach(ranks.connect())
    if ranks.rank != 0:
        tp_mod.follow(engine, ranks)
    engine.model = tp_mod.Leader(engine.model, ranks)
    engine.ranks = ranks


def _fail(ranks, e: BaseException) -> None:
    """A rank's load failed: the others hear of it at the agreement (unless it failed there: then it is
    everyone's already); every rank leaves the process group (gloo's threads would abort the exit), rank
    0 reaps what it started."""
    try:
        if isinstance(e, CpumlaError) and ranks.comm is None and not ranks.agreed:
            ranks.agree(("error", str(e)))
    finally:
        ranks.close()


def _load(model, hf_overrides, cfg, resolved, fam, ctx, where, quantizer, ckpt, dummy_weights, dummy_dtype, seed,
          threads, streams, ranks=None):
    """load() past its first checks; ckpt: the checkpoint already open for a quantizing load, else None;
    streams: (memory, expert_slots, expert_policy); ranks: this process's tensor-parallel place"""
    memory, expert_slots, policy = streams
    if expert_slots is not None and (dummy_weights or quantizer is not None):
        raise CpumlaError("expert slots read a checkpoint's experts from disk: not with dummy weights or --quant")
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
    b = None
    if quantizer is None and not dummy_weights:
        b = streaming.budget(fam, cfg, src, ctx, memory)
        if b.routed == 0 or (b.fits and expert_slots is None):
            b = None                                    # runs mapped, as any model that fits
        elif memory is None and expert_slots is None and not b.holds(cfg.num_experts_per_tok):
            b = None    # the memory measured here cannot hold a token's experts: mapped, from the page cache
        elif ranks is not None:
            raise CpumlaError("tensor-parallel ranks hold their slices in memory: routed experts read from disk "
                              "(--expert-slots, or a model larger than the memory) are not supported with them yet")
        else:
            src = streaming.ResidentSource(src)
    if quantizer is not None:
        quantizer.plan_total(src, fam.tensors(cfg))
        src.quantizer = quantizer
    engine = Engine(fam, cfg, src, max_seq_len=ctx, threads=threads, shard=ranks.shard if ranks is not None else None)
    if b is not None:
        try:
            engine.stream = streaming.start(engine.model, src, b, cfg.num_experts_per_tok, where, expert_slots, policy)
        except BaseException:
            engine.close()
            raise
    return engine
