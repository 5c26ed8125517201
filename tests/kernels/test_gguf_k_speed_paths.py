"""The K types' own gemv / gemm paths (x86 gqk_x86.h, gqk_avx512.h) bit for bit the scalar spec on every
level: row counts around the 4-row tiles, 1..20 tokens, several super-blocks a row, strided rows, and
extreme blocks (every code at its end, largest scales and mins, fp16 d at its extremes) against
activations at full code range."""

from __future__ import annotations

import numpy as np
import pytest

from cpumla import native

K_TYPES = ["q2_k", "q3_k", "q4_k", "q5_k", "q6_k"]
# byte offsets of the fp16 d (and dmin) of each K block
F16_AT = {"q2_k": (80, 82), "q3_k": (108,), "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,)}


def k_blocks(fmt, rows, cols, seed=0, fill=None):
    """[rows, row bytes] of random blocks (or every byte `fill`) with finite fp16 scales."""
    _, per = native.GGUF_FORMATS[fmt]
    rng = np.random.default_rng(seed)
    n = rows * (cols // 256)
    raw = rng.integers(0, 256, (n, per), dtype=np.uint8) if fill is None else np.full((n, per), fill, np.uint8)
    for at in F16_AT[fmt]:
        v = (rng.uniform(0.2, 1.0, n) * 10.0 ** rng.uniform(-4, 0, n) * rng.choice([-1, 1], n)).astype(np.float16)
        raw[:, at:at + 2] = v.view(np.uint8).reshape(n, 2)
    return raw.reshape(rows, -1)


def spec_of(w, x, isa):
    native.init("scalar")
    try:
        return native.gemm(w, x)
    finally:
        native.init(isa)


def check(w, x, isa):
    y = native.gemm(w, x)
    assert np.array_equal(y, spec_of(w, x, isa)), f"{w.dtype} on {isa}: gemm differs from the scalar spec"
    for t in range(min(x.shape[0], 3)):
        assert np.array_equal(native.gemv(w, x[t]), y[t]), f"{w.dtype} on {isa}: gemv differs from gemm"


@pytest.mark.parametrize("fmt", K_TYPES)
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 9, 30, 67])
def test_row_counts(isa, fmt, rows):
    w = native.Weight(k_blocks(fmt, rows, 768, seed=rows), fmt)
    x = np.random.default_rng(rows).standard_normal((2, 768)).astype(np.float32)
    check(w, x, isa)


@pytest.mark.parametrize("fmt", K_TYPES)
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8, 13, 20])
def test_token_counts(isa, fmt, n):
    w = native.Weight(k_blocks(fmt, 11, 512, seed=n), fmt)
    x = np.random.default_rng(n).standard_normal((n, 512)).astype(np.float32)
    x[0, :100] *= 1e-4
    check(w, x, isa)


@pytest.mark.parametrize("fmt", K_TYPES)
@pytest.mark.parametrize("rows,n", [(16, 16), (19, 17), (37, 40), (5, 48)])
def test_token_groups(isa, fmt, rows, n):
    """The panels of 16 rows and groups of 16 tokens (avx512vnni_gqp.c, amx_gq.c): partial panels and
    groups, several of each, activations of every scale."""
    w = native.Weight(k_blocks(fmt, rows, 768, seed=rows + n), fmt)
    x = np.random.default_rng(n).standard_normal((n, 768)).astype(np.float32)
    x[::3] *= 1e-3
    x[1, 256:512] = 0.0
    check(w, x, isa)


@pytest.mark.parametrize("fmt", K_TYPES)
def test_strided_rows(isa, fmt):
    raw = k_blocks(fmt, 40, 512, seed=3)
    view = raw[3::3]                                   # 13 rows, 3 row strides apart
    w, packed = native.Weight(view, fmt), native.Weight(np.ascontiguousarray(view), fmt)
    x = np.random.default_rng(4).standard_normal((3, 512)).astype(np.float32)
    check(w, x, isa)
    assert np.array_equal(native.gemm(w, x), native.gemm(packed, x))
    assert np.array_equal(native.gemv(w, x[0]), native.gemv(packed, x[0]))


@pytest.mark.parametrize("fmt", K_TYPES)
@pytest.mark.parametrize("fill", [0x00, 0xFF, 0xAA, 0x55])
def test_extreme_blocks(isa, fmt, fill):
    """Every byte the same (every code, scale and min at an end), d / dmin the largest and smallest
    normal fp16, activations at +-127 codes and a block of zeros."""
    raw = k_blocks(fmt, 9, 512, fill=fill)
    blocks = raw.reshape(-1, native.GGUF_FORMATS[fmt][1])
    big, small = np.array([65504.0, -6.1035156e-05], np.float16).view(np.uint8).reshape(2, 2)
    for at in F16_AT[fmt]:
        blocks[0::2, at:at + 2] = big
        blocks[1::2, at:at + 2] = small
    w = native.Weight(raw, fmt)
    x = np.where(np.arange(512) % 3 == 0, -1.0, 1.0).astype(np.float32)[None].repeat(18, 0)   # 18: the panels too
    x[1] = -x[1]
    x[2, 256:288] = 0.0
    x[3] = np.random.default_rng(0).standard_normal(512).astype(np.float32) * 1e-3
    x[4, ::2] = 0.0
    x[5:] = np.random.default_rng(1).choice([-1.0, 1.0], (13, 512)).astype(np.float32)
    check(w, x, isa)
