"""How each weight format is stored in a safetensors checkpoint, and what a config's
quantization_config may say: the checkpoint's own formats (f32, bf16, f16, FP8 block-scaled) and
cpumla's q8 / q4 (cpumla.h), whose layout `cpumla quantize` writes (docs/quantization.md)."""

from __future__ import annotations

from cpumla import native
from cpumla.errors import CpumlaError

FORMAT_OF = {"F32": "f32", "BF16": "bf16", "F16": "f16", "F8_E4M3": "e4m3"}
QUANTS = native.QUANT_FORMATS              # --quant: cpumla's q8 / q4 (cpumla.h)
QSCALE = "_qscale"                         # tensor X of a q8 / q4 checkpoint has its F16 scales in X + QSCALE
Q_DTYPE = {"q8": "I8", "q4": "U8"}         # how a q8 / q4 tensor is stored in safetensors
QUANT_VERSION = 1         # the layout of a checkpoint `cpumla quantize` writes (docs/quantization.md)


def scale_names(name: str) -> list[str]:
    """The scale grids a checkpoint may store beside weight `name`: FP8's weight_scale_inv (V2/V3),
    the official V4 `.scale` (FP8 and FP4), cpumla's q8 / q4 `_qscale`."""
    base = name[: -len(".weight")] if name.endswith(".weight") else name
    return [base + ".weight_scale_inv", base + ".scale", name + QSCALE]


def check_quant_config(qc, source: str) -> None:
    """config.json's quantization_config: none, FP8 block (as DeepSeek ships), or cpumla's q8 / q4."""
    if not qc:
        return
    if not isinstance(qc, dict):
        raise CpumlaError(f"{source}: quantization_config must be an object")
    method = qc.get("quant_method")
    if method in (None, "fp8"):
        return
    if method != "cpumla":
        raise CpumlaError(f"{source}: quantization '{method}' is not supported (fp8 block, or cpumla's q8 / q4)")
    if qc.get("format_version") != QUANT_VERSION:
        raise CpumlaError(f"{source}: cpumla quantization format_version {qc.get('format_version')!r} is not one this "
                          f"cpumla reads ({QUANT_VERSION})")
    if qc.get("format") not in QUANTS or qc.get("group_size") != native.QBLOCK:
        raise CpumlaError(f"{source}: cpumla quantization wants format q8 or q4 with group_size {native.QBLOCK}, "
                          f"got {qc.get('format')!r} / {qc.get('group_size')!r}")


def quantized_as(cfg) -> str | None:
    """q8 / q4 when the config says the checkpoint is cpumla-quantized, else None."""
    qc = getattr(cfg, "quantization_config", None) or {}
    return qc.get("format") if qc.get("quant_method") == "cpumla" else None
