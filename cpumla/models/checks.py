"""Checks of config values shared by the families: integer and real fields, and the rope_scaling and
quantization_config objects, each failing with one message naming the field (the family's validate
adds the file it came from)."""

from __future__ import annotations

import math

MAX_SIZE = 2**31 - 1       # the kernels index rows, experts and tokens with int32


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_real(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def short(v) -> str:
    """A config value for a one-line message: repr, cut to 40 characters."""
    r = repr(v)
    return r if len(r) <= 40 else r[:37] + "..."


def validate_rope_scaling(cfg, need) -> None:
    """rope_scaling: absent, or an object; YaRN needs original_max_position_embeddings >= 1 and finite
    positive factor / betas (everything rope_frequencies and softmax_scale read)."""
    rs = cfg.rope_scaling
    if rs is None:
        return
    need(isinstance(rs, dict), f"'rope_scaling' must be an object, got {short(rs)}")
    kind = rs.get("rope_type", rs.get("type", "default"))
    need(isinstance(kind, str), f"'rope_scaling.rope_type' must be a string, got {short(kind)}")
    if not rs or kind == "default":
        return
    need(kind == "yarn", f"rope_scaling type '{kind}' is not supported (yarn only)")
    l0 = rs.get("original_max_position_embeddings")
    need(is_int(l0) and 1 <= l0 <= MAX_SIZE,
         f"'rope_scaling.original_max_position_embeddings' must be a positive integer for YaRN, got {short(l0)}")
    need(cfg.rope_theta > 1, f"'rope_theta' must be above 1 for YaRN, got {cfg.rope_theta!r}")
    for key, optional, lo in (("factor", True, 0.0), ("beta_fast", True, 0.0), ("beta_slow", True, 0.0),
                              ("mscale", True, None), ("mscale_all_dim", True, None), ("attention_factor", True, 0.0)):
        v = rs.get(key)
        if v is None and optional:
            continue
        need(is_real(v) and math.isfinite(v) and (lo is None or v > lo),
             f"'rope_scaling.{key}' must be a finite number{'' if lo is None else ' > 0'}, got {short(v)}")
    if rs.get("mscale_all_dim"):
        need(rs.get("factor") is not None, "'rope_scaling.factor' is required with mscale_all_dim")


def validate_quantization(qc, need) -> None:
    """quantization_config: absent, or an FP8 block-scaled description with a [rows, cols] block."""
    if qc is None:
        return
    need(isinstance(qc, dict), f"'quantization_config' must be an object, got {short(qc)}")
    method = qc.get("quant_method")
    if method == "cpumla":
        return                          # cpumla's q8 / q4: checkpoint.formats.check_quant_config
    need(method in (None, "fp8"), f"quantization {short(method)} is not supported (fp8 block, or cpumla's q8 / q4)")
    b = qc.get("weight_block_size")
    if b is None:
        return
    need(isinstance(b, list) and len(b) == 2 and all(is_int(x) and 1 <= x <= 65536 for x in b),
         f"'quantization_config.weight_block_size' must be two integers from 1 to 65536, got {short(b)}")
