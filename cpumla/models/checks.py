"""Checks of config values shared by the families: the per-field rules every family states as tables
(validate_fields), and the rope_scaling and quantization_config objects, each failing with one message
naming the field (the family's validate adds the file it came from)."""

from __future__ import annotations

import math

from cpumla.errors import CpumlaError

MAX_SIZE = 2**31 - 1       # the kernels index rows, experts and tokens with int32


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_real(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def short(v) -> str:
    """A config value for a one-line message: repr, cut to 40 characters."""
    r = repr(v)
    return r if len(r) <= 40 else r[:37] + "..."


def needer(source: str):
    """need(ok, message): raises CpumlaError("source: message") when not ok."""
    def need(ok, msg):
        if not ok:
            raise CpumlaError(f"{source}: {msg}")
    return need


def validate_fields(cfg, need) -> None:
    """Every field of the family's tables (class attributes of its Config), before anything is derived:
    SIZES  name -> (lowest, None allowed): integers (never booleans) from lowest to MAX_SIZE
    REALS  name -> (lowest, lowest included, None allowed): finite numbers (never booleans) above lowest
    BOOLS  names: true or false
    STRINGS name -> None allowed: strings
    and the token ids every family has (bos_token_id: an integer; eos_token_id: one or a list)."""
    for name, (lo, optional) in cfg.SIZES.items():
        v = getattr(cfg, name)
        if v is None and optional:
            continue
        need(is_int(v) and lo <= v <= MAX_SIZE, f"'{name}' must be an integer from {lo} to {MAX_SIZE}, got {short(v)}")
    for name, (lo, closed, optional) in cfg.REALS.items():
        v = getattr(cfg, name)
        if v is None and optional:
            continue
        need(is_real(v) and math.isfinite(v) and (v >= lo if closed else v > lo),
             f"'{name}' must be a finite number {'>=' if closed else '>'} {lo:g}, got {short(v)}")
    for name in cfg.BOOLS:
        need(isinstance(getattr(cfg, name), bool), f"'{name}' must be true or false, got {short(getattr(cfg, name))}")
    for name, optional in cfg.STRINGS.items():
        v = getattr(cfg, name)
        need((v is None and optional) or isinstance(v, str), f"'{name}' must be a string, got {short(v)}")
    need(cfg.bos_token_id is None or is_int(cfg.bos_token_id), f"'bos_token_id' must be an integer, got {short(cfg.bos_token_id)}")
    e = cfg.eos_token_id
    need(e is None or is_int(e) or (isinstance(e, list) and all(is_int(x) for x in e)),
         f"'eos_token_id' must be an integer or a list of integers, got {short(e)}")


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
