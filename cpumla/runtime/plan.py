"""What a model takes before it is loaded (`cpumla info MODEL`, and the loader's refusal of a model
that cannot fit): parameters, the bytes of its weights as released or stored and in bf16 / q8 / q4,
the cache per 1k tokens and at the context asked for, which of those fits this machine's memory, and the
weight bytes one decode token reads in each form (what its decode speed is bound by).

Everything comes from the config and, for a checkpoint directory, the safetensors headers: nothing is
read or allocated. The q8 / q4 bytes follow checkpoint.quant.quant_plan, the rule the loader quantizes by.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from cpumla.checkpoint.formats import QUANTS, quantized_as, scale_names
from cpumla.checkpoint.quant import quant_plan
from cpumla.checkpoint.safetensors import Checkpoint
from cpumla.errors import CpumlaError
from cpumla.models import PREFILL_CHUNK, family
from cpumla.models import shard as shards
from cpumla.runtime.engine import context_length
from cpumla.runtime.memory import available_memory, gib
from cpumla.native.stream import disk_probe
from cpumla.runtime.resolve import load_config
from cpumla.runtime.streaming import Budget, budget, is_routed

QBYTES = {"q8": 1.0, "q4": 0.5}          # bytes per weight of the codes; each block of 32 adds an fp16 scale
ITEM = {"F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "I8": 1, "U8": 1, "I64": 8, "I32": 4}


def _released_dtype(kind: str, fp8: bool) -> str:
    """The dtype a tensor of this kind has in the checkpoint as its makers release it."""
    if kind == "linear":
        return "F8_E4M3" if fp8 else "BF16"
    if kind in ("bias", "f32"):
        return "F32"
    if kind == "e4m3":
        return "F8_E4M3"
    if kind == "e2m1":
        return "E2M1"
    if kind.startswith("ids:"):
        return "I64"
    return "BF16"


def _bytes(shape, dtype: str, block, scale_bytes: int = 4) -> int:
    """Bytes of one tensor stored as dtype, its scale grid included (FP8: scale_bytes per block, fp32
    or E8M0; FP4: E8M0 per 32 inputs)."""
    n = math.prod(shape)
    if dtype == "E2M1":
        return n // 2 + shape[0] * -(-shape[-1] // 32)
    if dtype == "F8_E4M3" and len(shape) == 2:
        return n + scale_bytes * -(-shape[0] // block[0]) * -(-shape[1] // block[1])
    return ITEM.get(dtype, 2) * n


def _as(shape, fmt: str) -> int:
    n = math.prod(shape)
    return int(n * QBYTES[fmt]) + 2 * (n // 32)


@dataclass
class Plan:
    model: str
    model_type: str
    where: str                            # "preset ..." or the checkpoint directory
    params: int                           # parameters of every tensor the model reads
    stored: str                           # "as released" (a preset) or "as stored" (a checkpoint)
    weights: dict[str, int]               # format -> weight bytes (the stored form first)
    cache_per_1k: int                     # what the cache grows by per 1000 tokens
    ctx: int
    cache: int                            # cache bytes at ctx
    scratch: int
    available: int
    available_from: str
    quantized: str | None = None          # q8 / q4 when the checkpoint is cpumla-quantized
    notes: list[str] = field(default_factory=list)
    routed: int = 0                       # bytes of the routed experts (in the stored form)
    routed_per_token: int = 0             # of those, what one token reads (top_k a MoE layer, on average)
    disk_probe_gbps: float | None = None  # direct reads of the checkpoint's largest file, when it does not fit
    token_bytes: dict[str, int] = field(default_factory=dict)   # format -> weight bytes a decode token reads
    split: dict[str, int] = field(default_factory=dict)   # format -> bytes of the tensors tensor parallel splits
    split_token: dict[str, int] = field(default_factory=dict)   # ... and of those, what a decode token reads

    def per_rank(self, tp: int) -> dict:
        """What each of tp tensor-parallel ranks holds and reads a decode token, per format: the split
        tensors' 1/tp, every replicated one whole (models/shard.py). Caches and scratch: as one process."""
        return {"tp": tp,
                "weights": {f: round(w - self.split.get(f, 0) * (1 - 1 / tp)) for f, w in self.weights.items()},
                "token_bytes": {f: round(b - self.split_token.get(f, 0) * (1 - 1 / tp))
                                for f, b in self.token_bytes.items()}}

    def streamed(self) -> dict | None:
        """When the stored weights do not fit but the resident part does: what reading the routed experts
        from disk gives (runtime/streaming.py): the share of experts the slots hold, the expert bytes a
        token then reads from disk with uniform routing (the worst case), and the decode speed that the
        disk probe allows for them. None otherwise."""
        if self.routed == 0 or self.fits("stored"):
            return None
        b = Budget(self.available, self.available_from, self.weights["stored"] - self.routed, self.routed, 0,
                   self.cache, self.scratch)
        held = min(1.0, max(0.0, b.room / self.routed))
        missed = (1.0 - held) * self.routed_per_token
        return {"resident": b.resident + b.cache + b.scratch, "held": held,
                "disk_bytes_per_token": missed, "disk_probe_gbps": self.disk_probe_gbps,
                "tok_s_bound": self.disk_probe_gbps * 1e9 / missed if self.disk_probe_gbps and missed else None}

    def need(self, fmt: str) -> int:
        return self.weights[fmt] + self.cache + self.scratch

    def fits(self, fmt: str) -> bool:
        return self.need(fmt) <= self.available

    def decode_tok_s(self, fmt: str, read_gbs: float) -> float:
        """Decode tokens a second that a memory reading read_gbs GB/s allows in `fmt`: every token reads
        token_bytes[fmt] (the cache it attends to adds a little as it grows)."""
        return read_gbs * 1e9 / self.token_bytes[fmt]

    def smallest_fitting_quant(self) -> str | None:
        """The --quant that would fit (q8 before q4), or None when neither does or none applies."""
        for fmt in QUANTS:
            if fmt in self.weights and self.fits(fmt):
                return fmt
        return None

    def to_dict(self) -> dict:
        return {"model": self.model, "model_type": self.model_type, "where": self.where, "params": self.params,
                "stored": self.stored, "weights": self.weights, "cache_per_1k_tokens": self.cache_per_1k,
                "ctx": self.ctx, "cache": self.cache, "scratch": self.scratch, "available": self.available,
                "available_from": self.available_from, "quantized": self.quantized,
                "fits": {f: self.fits(f) for f in self.weights}, "notes": self.notes, "routed": self.routed,
                "routed_per_token": self.routed_per_token, "token_bytes": self.token_bytes,
                "streamed": self.streamed(), "split": self.split}


def plan(model: str, hf_overrides=None, max_seq_len: int | None = None, loaded=None, dummy: bool = False) -> Plan:
    """The Plan of `model` (a directory, a cached repo id or a preset). Raises CpumlaError as load does
    for a model it cannot resolve. loaded: (cfg, resolved, checkpoint or None) the caller already made
    of this model and overrides (load_config, and its directory's Checkpoint, left open here). dummy:
    planned as its config alone (dummy weights), its directory's checkpoint never opened."""
    cfg, resolved, src = loaded if loaded is not None else (*load_config(model, hf_overrides), None)
    fam = family(cfg.model_type)
    ctx = context_length(cfg, max_seq_len)
    groups = fam.weight_groups(cfg) if hasattr(fam, "weight_groups") else \
        [(name, shape, kind, 1) for name, (shape, kind) in fam.tensors(cfg).items()]
    block = tuple(getattr(cfg, "block", (128, 128)))
    quantizable = getattr(fam, "QUANTIZABLE", True) and quantized_as(cfg) is None and resolved.gguf is None
    qc = getattr(cfg, "quantization_config", None) or {}
    fp8 = qc.get("quant_method") == "fp8"
    scale_bytes = 1 if qc.get("scale_fmt") == "ue8m0" else 4
    own = src is None and resolved.directory is not None and resolved.gguf is None and not dummy
    if own:
        src = Checkpoint(resolved.directory)
    elif src is None and not dummy:
        src = resolved.gguf
    routed = embed = mtp_resident = mtp_routed = 0
    in_mtp = getattr(fam, "is_mtp", lambda cfg, name: False)   # V3's MTP layer: loaded, not decoded with
    experts = getattr(cfg, "n_routed_experts", 0) or 0
    top_k = getattr(cfg, "num_experts_per_tok", 0) or 0
    try:
        params, sizes = 0, {"stored": 0, **({"bf16": 0, **{f: 0 for f in QUANTS}} if quantizable else {})}
        per_token = dict.fromkeys(sizes, 0.0)       # of those bytes, what a decode token reads
        split, split_token = dict.fromkeys(sizes, 0), dict.fromkeys(sizes, 0.0)
        for name, shape, kind, count in groups:
            n = math.prod(shape)
            mtp = in_mtp(cfg, name)
            if mtp and src is not None and not src.has(name):
                continue                            # a checkpoint without the MTP layer
            params += 0 if mtp else n * count       # the model's parameters as its card counts them
            # a token reads top_k of the routed experts, one row of the embedding (and of V4's hash table)
            share = 0.0 if mtp else top_k / experts if is_routed(name) and experts else \
                1 / shape[0] if kind == "embed" or kind.startswith("ids:") else 1.0
            if src is not None and src.has(name):
                dtype, got = src.info(name)
                stored = src.tensor_nbytes(name) + sum(src.tensor_nbytes(s) for s in scale_names(name) if src.has(s))
                shape = tuple(got) if dtype != "U8" else tuple(shape)
            else:
                dtype = _released_dtype(kind, fp8)
                stored = _bytes(shape, dtype, block, scale_bytes)
            b = {"stored": stored}
            if mtp:
                mtp_routed += stored * count if is_routed(name) else 0
                mtp_resident += 0 if is_routed(name) else stored * count
            if is_routed(name):
                routed += stored * count
            elif share != 1.0 and not mtp:
                embed += stored * count
            if quantizable:
                b["bf16"] = stored if dtype in ("F32", "I64", "I32") else 2 * n
                for fmt in QUANTS:
                    to = quant_plan(name, dtype, shape, fmt) if kind in ("linear", "plain") else None
                    b[fmt] = _as(shape, to) if to else stored
            for fmt, v in b.items():
                sizes[fmt] += v * count
                per_token[fmt] += v * count * share
                if shards.is_split(name):
                    split[fmt] += v * count
                    split_token[fmt] += v * count * share
        if src is not None:     # as stored, tensor by tensor: a file's types may differ by layer (GGUF's mixes)
            exact = budget(fam, cfg, src, ctx, 1)
            sizes["stored"], routed = exact.resident + exact.routed, exact.routed
            per_token["stored"] = exact.resident - mtp_resident - embed * (1 - 1 / cfg.vocab_size) + \
                (routed - mtp_routed) * top_k / max(experts, 1)
    finally:
        if own:
            src.close()
    mem = fam.memory_bytes(cfg, ctx, "bf16", PREFILL_CHUNK)
    # the cache grows by this much per 1000 tokens (V4 also holds fixed rings: that part is in `cache`)
    k1 = fam.memory_bytes(cfg, 2000, "bf16", PREFILL_CHUNK)["cache"] - fam.memory_bytes(cfg, 1000, "bf16", PREFILL_CHUNK)["cache"]
    avail, what = available_memory()
    notes = []
    if not quantizable:
        notes.append("already quantized: --quant does not apply" if quantized_as(cfg)
                     else "a GGUF model runs as stored: --quant does not apply" if resolved.gguf is not None
                     else f"--quant is not supported for {cfg.model_type}")
    if sizes.get("bf16") == sizes["stored"]:
        for d in (sizes, per_token, split, split_token):
            d.pop("bf16")
    probe = None
    if routed and sizes["stored"] + mem["cache"] + mem["scratch"] > avail and not dummy:
        probe = disk_probe_gbps(resolved)
    return Plan(model=model, model_type=cfg.model_type,
                where=str(resolved.directory) if resolved.directory else f"preset {model}", params=params,
                stored="as stored" if src is not None else "as released", weights=sizes,
                cache_per_1k=k1, ctx=ctx, cache=mem["cache"], scratch=mem["scratch"], available=avail,
                available_from=what, quantized=quantized_as(cfg), notes=notes, routed=routed,
                routed_per_token=(routed - mtp_routed) * top_k // experts if experts else 0, disk_probe_gbps=probe,
                token_bytes={f: round(v) for f, v in per_token.items()}, split=split,
                split_token={f: round(v) for f, v in split_token.items()})


def disk_probe_gbps(resolved) -> float | None:
    """GB/s of direct reads of the largest file of a local checkpoint (256 MiB of it), or None."""
    if resolved.gguf is not None:
        files = list(resolved.gguf.file.files)
    elif resolved.directory is not None:
        files = list(resolved.directory.glob("*.safetensors"))
    else:
        return None
    if not files:
        return None
    try:
        return disk_probe(max(files, key=lambda f: f.stat().st_size), 256 << 20)[0] / 1e9
    except (CpumlaError, OSError):
        return None


def check_fits(p: Plan, fmt: str, what: str) -> None:
    """Refuses (CpumlaError, one line) a load whose weights in `fmt` plus cache and scratch exceed the
    memory available, naming the --quant that would fit."""
    if p.fits(fmt):
        return
    hint = p.smallest_fitting_quant()
    tail = f"; --quant {hint} would fit ({gib(p.need(hint))})" if hint and hint != fmt else \
        "; use a smaller --ctx / max_seq_len or a smaller model"
    raise CpumlaError(f"{p.where}: needs {gib(p.need(fmt))} of memory ({what} {gib(p.weights[fmt])}, caches "
                      f"{gib(p.cache)}, scratch {gib(p.scratch)}) but {gib(p.available)} is available "
                      f"({p.available_from}){tail}")


__all__ = ["Plan", "plan", "check_fits", "CpumlaError"]
