"""GGUF's block types read in place (gguf_q.h, kernels.h), every one of them: dequant bit for bit the
gguf package's dequantize; the products of every level bit for bit the scalar spec's; the spec's result
against float64 sums of the dequantized weights times the quantized activations; the MLA absorb
(head_gemv_t) against float64. Blocks are random bytes with sane fp16 scales, so every code, sign
pattern, grid index and sub-scale occurs."""

from __future__ import annotations

import numpy as np
import pytest

from cpumla import native
from cpumla.errors import CpumlaError

gguf = pytest.importorskip("gguf")
T = gguf.GGMLQuantizationType

# fp16 fields to overwrite with sane scales: byte offsets of d (and of a second fp16: min / dmin)
F16_AT = {"q8_0": (0,), "q4_0": (0,), "q4_1": (0, 2), "q5_0": (0,), "q5_1": (0, 2), "iq4_nl": (0,),
          "q2_k": (80, 82), "q3_k": (108,), "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,), "iq4_xs": (0,),
          "iq2_xxs": (0,), "iq3_xxs": (0,), "iq1_s": (0,), "iq1_m": (), "mxfp4": ()}
TYPES = list(F16_AT)


def blocks(fmt, rows, cols, seed=0):
    """[rows, row bytes] of random blocks of fmt with finite scales of varied size."""
    block, per = native.GGUF_FORMATS[fmt]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, cols // block, per), dtype=np.uint8)
    n = rows * (cols // block)
    for at in F16_AT[fmt]:
        v = (rng.uniform(0.2, 1.0, n) * 10.0 ** rng.uniform(-3, 0, n) * rng.choice([-1, 1], n)).astype(np.float16)
        raw.reshape(n, per)[:, at:at + 2] = v.view(np.uint8).reshape(n, 2)
    if fmt == "iq1_m":                              # d's 16 bits are the top nibbles of the 4 scale words
        d = (rng.uniform(0.2, 1.0, n) * 10.0 ** rng.uniform(-3, -1, n)).astype(np.float16).view(np.uint16)
        sc = raw.reshape(n, per)[:, 48:56].copy().view(np.uint16)
        for i in range(4):
            sc[:, i] = (sc[:, i] & 0x0FFF) | (((d >> (4 * i)) & 0xF) << 12)
        raw.reshape(n, per)[:, 48:56] = sc.view(np.uint8)
    if fmt == "mxfp4":                              # exponents around 2^0, and the subnormal e = 0, 1
        raw.reshape(n, per)[:, 0] = rng.integers(118, 136, n)
        raw.reshape(n, per)[0, 0] = 0
        raw.reshape(n, per)[-1, 0] = 1
    return raw.reshape(rows, -1)


def quant_act(x):
    """The activations as every GGUF product quantizes them (kernels.h): int codes and xd per 32."""
    xb = x.astype(np.float32).reshape(-1, 32)
    amax = np.abs(xb).max(1)
    big = amax >= np.float32(2.0 ** -100)
    with np.errstate(divide="ignore"):
        ident = np.where(big, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    xq = np.rint(xb * ident[:, None]).astype(np.float64)
    xd = np.where(big, amax / np.float32(127), np.float32(0)).astype(np.float32)
    return xq, xd


def dequantized(raw, fmt):
    return gguf.quants.dequantize(raw, T[fmt.upper()]).astype(np.float32)


@pytest.mark.parametrize("fmt", TYPES)
def test_dequant_is_gguf_dequantize(fmt):
    block = native.GGUF_FORMATS[fmt][0]
    raw = blocks(fmt, 5, 2 * max(block, 256), seed=len(fmt))
    w = native.Weight(raw, fmt)
    assert (w.rows, w.cols) == (5, 2 * max(block, 256))
    want = dequantized(raw, fmt)
    got = native.dequant(w)
    assert np.array_equal(got, want), f"{fmt}: {np.abs(got - want).max()}"


@pytest.mark.parametrize("fmt", TYPES)
def test_products_every_level_are_the_spec(isa, fmt):
    block = native.GGUF_FORMATS[fmt][0]
    cols = 512 if block == 256 else 288                       # 288: 9 blocks, a partial group of 8
    raw = blocks(fmt, 13, cols, seed=7 + len(fmt))
    w = native.Weight(raw, fmt)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, cols)).astype(np.float32)
    x[1, :32] = 0.0
    x[2, 64:] *= 1e-3
    y = native.gemm(w, x)
    assert np.array_equal(native.gemv(w, x[0]), y[0])
    native.init("scalar")
    try:
        spec = native.gemm(w, x)
    finally:
        native.init(isa)
    assert np.array_equal(y, spec), f"{fmt} on {isa}: differs from the scalar spec"
    if isa != "neon":
        assert native.kernel_impl(f"gemm:{fmt}") is not None
    # the spec against float64: dequantized weights times the quantized activations
    wd = dequantized(raw, fmt).astype(np.float64)
    for t in range(x.shape[0]):
        xq, xd = quant_act(x[t])
        xa = (xq * xd.astype(np.float64)[:, None]).reshape(-1)
        terms = np.abs(wd) @ np.abs(xa)
        ref = wd @ xa
        tol = 2e-7 * (cols // 32 + 4) * terms + 1e-30
        assert np.all(np.abs(y[t] - ref) <= tol), f"{fmt} row {t}: {np.max(np.abs(y[t] - ref) / (terms + 1e-30))}"


@pytest.mark.parametrize("fmt", ["q4_k", "q6_k", "iq2_xxs", "q4_0", "mxfp4"])
def test_strided_rows_of_stacked_tensor(fmt):
    """An expert of a stacked tensor: rows strided, products and dequant as on a packed copy."""
    raw = blocks(fmt, 3 * 8, 256, seed=11).reshape(3, 8, -1)
    view = raw[1][::2]
    w, packed = native.Weight(view, fmt), native.Weight(np.ascontiguousarray(view), fmt)
    x = np.random.default_rng(5).standard_normal((2, 256)).astype(np.float32)
    assert np.array_equal(native.gemm(w, x), native.gemm(packed, x))
    assert np.array_equal(native.dequant(w), dequantized(np.ascontiguousarray(view), fmt))


@pytest.mark.parametrize("fmt", ["q4_k", "q2_k", "iq3_xxs", "q5_1"])
def test_mla_absorb_against_float64(fmt):
    """head_gemv_t (the MLA absorb: y = x^T W over a head's rows) on a GGUF weight."""
    raw = blocks(fmt, 16, 256, seed=2)
    w = native.Weight(raw, fmt)
    x = np.random.default_rng(9).standard_normal((1, 2, 8)).astype(np.float32)
    got = native.head_gemv_t(w, 0, 8, 8, x)[0]
    x = x[0]
    wd = dequantized(raw, fmt).astype(np.float64)
    for h in range(2):
        ref = x[h].astype(np.float64) @ wd[8 * h:8 * h + 8]
        terms = np.abs(x[h]).astype(np.float64) @ np.abs(wd[8 * h:8 * h + 8])
        assert np.all(np.abs(got[h] - ref) <= 1e-6 * terms + 1e-30)


def test_bad_block_bytes_refused():
    with pytest.raises(CpumlaError, match="whole 144-byte blocks"):
        native.Weight(np.zeros((2, 100), np.uint8), "q4_k")


def rows_37(fmt, seed):
    """A weight of 37 rows of random blocks (panels of 16 rows and a partial one), two super-blocks or 9
    blocks wide, and its width."""
    cols = 512 if native.GGUF_FORMATS[fmt][0] == 256 else 288
    return native.Weight(blocks(fmt, 37, cols, seed=seed), fmt), cols


@pytest.mark.parametrize("fmt", TYPES)
def test_token_panels_are_the_spec(isa, fmt):
    """Every level's gemm over as many tokens as prefill gives it (the panels of avx2_gqp.c from 8 tokens,
    avx512vnni_gqp.c's from 16): 8 tokens (one group), 17 (groups of 8 and 16, and one token over), 43;
    37 rows (panels of 16 and a partial one, a partial tile of 4 rows); a token of zeros, one of tiny
    values, one with a NaN: bit for bit the spec."""
    w, cols = rows_37(fmt, seed=13 + len(fmt))
    rng = np.random.default_rng(8)
    x = rng.standard_normal((43, cols)).astype(np.float32)
    x[2] = 0.0
    x[9, 32:] *= 1e-4
    x[40, 7] = np.nan
    got = [native.gemm(w, x[:n]) for n in (8, 17, 43)]
    native.init("scalar")
    try:
        spec = [native.gemm(w, x[:n]) for n in (8, 17, 43)]
    finally:
        native.init(isa)
    for n, g, s in zip((8, 17, 43), got, spec):
        assert np.array_equal(g.view(np.uint32), s.view(np.uint32)), f"{fmt} on {isa}, {n} tokens: differs from the spec"


@pytest.mark.skipif("amx" not in native.available_isas(), reason="the amx level needs an AMX CPU and OS support")
@pytest.mark.parametrize("fmt", TYPES)
def test_amx_tiles_are_the_spec(fmt):
    """The amx level's tiles (amx_gq.c), which serve from 16 tokens: every type at 17 tokens (a group of
    16 and one of 1) and at 161 (a partial group of 16), panels of 16 rows and a partial one, chunks whose
    halves differ and agree: bit for bit the spec."""
    w, cols = rows_37(fmt, seed=11 + len(fmt))
    rng = np.random.default_rng(5)
    x = rng.standard_normal((161, cols)).astype(np.float32)
    x[3, :32] = 0.0
    x[40, 64:] *= 1e-3
    x[150, 5] = np.nan
    native.init("amx")
    try:
        assert native.kernel_impl(f"gemm:{fmt}").startswith("amx")
        got = [native.gemm(w, x[:n]) for n in (17, 161)]
        native.init("scalar")
        spec = [native.gemm(w, x[:n]) for n in (17, 161)]
    finally:
        native.init()
    for g, s in zip(got, spec):
        assert np.array_equal(g.view(np.uint32), s.view(np.uint32)), f"{fmt}: {np.nanmax(np.abs(g - s))}"
