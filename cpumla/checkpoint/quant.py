"""Quantize on load (cpumla.load(..., quant=)): which weights take q8 / q4 (quant_plan, also the rule
of `cpumla quantize` and of `cpumla info`'s byte counts), and the Quantizer that makes them."""

from __future__ import annotations

import numpy as np

from cpumla import native
from cpumla.checkpoint.arena import HugeArena, drop_current_block
from cpumla.checkpoint.formats import QUANTS
from cpumla.errors import CpumlaError


def quant_plan(name: str, dtype: str, shape, fmt: str) -> str | None:
    """The format a weight takes under --quant fmt, or None to keep it as stored. Kept: the MoE router
    (its logits pick experts: fp32 products, as transformers), V3.2's indexer (it picks the attended
    tokens), V4's mHC mixers, FP4 (already 4.25 bits), and widths not a multiple of 32. The output
    head (lm_head, or the embedding tied to it) and kv_b_proj (the per-head up-projection of the latent
    cache, under 0.5% of the bytes) are q8 under q4 too: docs/quantization.md measures both."""
    if dtype not in ("F32", "BF16", "F16", "F8_E4M3") or len(shape) != 2 or shape[1] % native.QBLOCK:
        return None
    if name.endswith(("mlp.gate.weight", "ffn.gate.weight")) or ".indexer." in name \
            or name.split(".")[-1].startswith("hc_"):
        return None
    if name in ("lm_head.weight", "head.weight", "model.embed_tokens.weight", "embed.weight") \
            or name.endswith("kv_b_proj.weight"):
        return "q8"
    return fmt


class Quantizer:
    """Quantize-on-load (cpumla.load(..., quant=)): linear() hands it each weight as stored, and it
    returns the q8 / q4 Weight quant_plan() asks for (else the weight unchanged), made on every thread
    (native.quantize) into huge-page memory. progress(done, total) is called with element counts after
    each step of rows: total is what the model's tensor table plans (set by plan_total)."""

    STEP = 1 << 22          # elements quantized between progress calls

    def __init__(self, fmt: str, progress=None):
        if fmt not in QUANTS:
            raise CpumlaError(f"--quant must be one of {', '.join(QUANTS)}, not '{fmt}'")
        self.fmt, self.progress = fmt, progress
        self.done, self.total = 0, 0
        self.formats: dict[str, int] = {}          # format -> weights made in it
        # every code and scale array in huge pages (small ones too), in mappings of this load's own that
        # go away with the last of its weights
        self.arena = HugeArena()

    def plan_total(self, src, table: dict) -> int:
        """Elements the model's tensors (family tensors()) will quantize, for the progress total."""
        total = 0
        tied = not any(src.has(h) for h in ("lm_head.weight", "head.weight"))
        for name, (shape, kind) in table.items():
            if kind in ("norm", "bias") or (kind == "embed" and not tied):     # read by vector(): never quantized
                continue
            if src.has(name) and quant_plan(name, src.info(name)[0], src.info(name)[1], self.fmt):
                total += int(np.prod(shape))
        self.total = total
        return total

    def __call__(self, name: str, w: native.Weight) -> native.Weight:
        if w.dtype in QUANTS:
            raise CpumlaError(f"tensor '{name}' is already {w.dtype}: this checkpoint is quantized; leave out --quant")
        fmt = quant_plan(name, {"f32": "F32", "bf16": "BF16", "f16": "F16", "e4m3": "F8_E4M3"}.get(w.dtype, ""),
                         (w.rows, w.cols), self.fmt)
        if fmt is None:
            return w
        data = self.arena.empty((w.rows, w.cols // (2 if fmt == "q4" else 1)), np.int8 if fmt == "q8" else np.uint8,
                                small=True)
        scale = self.arena.empty((w.rows, w.cols // native.QBLOCK), np.float16, small=True)
        step = max(1, self.STEP // max(1, w.cols))
        out = None
        for r0 in range(0, w.rows, step):
            r1 = min(w.rows, r0 + step)
            out = native.quantize(w, fmt, data, scale, rows=(r0, r1))
            self.done += (r1 - r0) * w.cols
            if self.progress is not None:
                self.progress(self.done, max(self.total, self.done))
        self.formats[fmt] = self.formats.get(fmt, 0) + 1
        # the source (a dummy weight in the shared arena) dies with the caller's reference: let its
        # mapping die with it rather than stay resident as the arena's current block
        drop_current_block()
        return out
