"""No speed cliff and no result that depends on which codes a weight holds.

Intel cores take a microcode assist (~150 cycles) on a multiply with a subnormal operand or result,
so a kernel that decoded e4m3's subnormal codes (|value| < 2^-6) into fp32 subnormals ran many times
slower on weights with such codes. The hot loops now multiply only normal operands; this file checks
it by construction on every implementation this machine runs: the weight operands each GEMV loop
really multiplies (cpumla_decode_operands, the loops' own decode helpers run on all 256 e4m3 and 16
e2m1 codes) are normal or zero and equal the codes' values times a power of two, and results on
adversarial code distributions (all subnormal codes, random codes, all zero) are exact: bit for bit
the spec's (scalar.c) on one-hot rows, within fp32 summation of a float64 reference on full rows."""

from __future__ import annotations

import numpy as np
import pytest

from cpumla import native
from cpumla.errors import CpumlaError

from support import reference as ref

FLT_MIN = float(np.finfo(np.float32).tiny)

# codes of each distribution (e4m3 bytes / e2m1 nibbles); NaN codes 0x7f, 0xff left out
E4M3_CODES = {
    "subnormal": np.array([e | s for e in range(1, 8) for s in (0, 0x80)], np.uint8),
    "random": np.array([c for c in range(256) if c & 0x7F != 0x7F], np.uint8),
    "zero": np.array([0x00, 0x80], np.uint8),
}
E2M1_CODES = {"subnormal": np.array([1, 9], np.uint8), "random": np.arange(16, dtype=np.uint8),
              "zero": np.array([0, 8], np.uint8)}


@pytest.mark.parametrize("fmt", ["e4m3"])
def test_decode_operands_are_normal_and_exact(fmt):
    """Every code's operand in every GEMV loop: normal (or zero), and value * 2^-k exactly."""
    n = 256 if fmt == "e4m3" else 16
    codes = np.arange(n, dtype=np.uint8)
    want = ref.e4m3_value(codes) if fmt == "e4m3" else ref.E2M1[codes]
    for isa in native.available_isas():
        got, k = native.decode_operands(isa, fmt)
        assert got.shape == (n,)
        g = got.astype(np.float64)
        nonzero = (g != 0) & np.isfinite(g)
        assert (np.abs(g[nonzero]) >= FLT_MIN).all(), \
            f"{isa} {fmt}: subnormal operands for codes {codes[nonzero & (np.abs(g) < FLT_MIN)]}"
        ok = np.isnan(want) | (np.ldexp(g, k) == want)
        assert ok.all(), f"{isa} {fmt}: codes {codes[~ok]} decode to {np.ldexp(g, k)[~ok]}, want {want[~ok]}"
        assert (np.signbit(np.ldexp(g, k)) == np.signbit(want))[~np.isnan(want)].all(), f"{isa} {fmt}: sign of zero"


def _weight(fmt, codes, rows, cols, rng, scale_kind):
    """A weight whose every code is drawn from `codes`, with its scales"""
    if fmt == "e4m3":
        q = rng.choice(codes, size=(rows, cols))
        grid = (-(-rows // 128), -(-cols // 128))
        if scale_kind == "e8m0":
            s = rng.integers(118, 124, size=grid).astype(np.uint8)
        else:
            s = rng.uniform(0.002, 0.02, size=grid).astype(np.float32)
        return q, s, (128, 128)
    nib = rng.choice(codes, size=(rows, cols))
    q = (nib[:, 0::2] | (nib[:, 1::2] << 4)).astype(np.uint8)
    return q, rng.integers(118, 124, size=(rows, cols // 32)).astype(np.uint8), (1, 32)


CASES = [("e4m3", "f32", 130, 300), ("e4m3", "e8m0", 64, 256), ("e2m1", "e8m0", 40, 256), ("e2m1", "e8m0", 9, 96)]


@pytest.mark.parametrize("dist", ["subnormal", "random", "zero"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}-{c[2]}x{c[3]}")
def test_adversarial_codes(isa, dist, case):
    """gemv, gemm (panel and single-token paths), head_gemv_t and dequant on weights holding only one
    distribution's codes match the float64 reference."""
    fmt, scale_kind, rows, cols = case
    rng = np.random.default_rng(7)
    codes = (E4M3_CODES if fmt == "e4m3" else E2M1_CODES)[dist]
    data, scale, block = _weight(fmt, codes, rows, cols, rng, scale_kind)
    w, lin = native.Weight(data, fmt, scale, block), ref.Linear(fmt, data, scale, block)
    x = rng.standard_normal((6, cols)).astype(np.float32)
    p = lin.terms(x)
    want, mag = p.sum(-1), np.abs(p).sum(-1)
    bound = 2e-5 * mag + 1e-30
    y = native.gemv(w, x[0])
    assert (np.abs(y - want[0]) <= bound[0]).all(), f"gemv {isa} {dist}"
    for n in (2, 6):
        y = native.gemm(w, x[:n])
        assert (np.abs(y - want[:n]) <= bound[:n]).all(), f"gemm n={n} {isa} {dist}"
    assert np.array_equal(native.dequant(w), lin.W.astype(np.float32)), f"dequant {isa} {dist}"
    if fmt == "e4m3":
        xt = rng.standard_normal(rows).astype(np.float32)
        pt = lin.terms_t(xt)
        got = native.head_gemv_t(w, 0, rows, rows, xt[None, None, :])[0, 0]
        assert (np.abs(got - pt.sum(0)) <= 2e-5 * np.abs(pt).sum(0) + 1e-30).all(), f"gemv_t {isa} {dist}"


@pytest.mark.parametrize("scale_kind", ["f32", "e8m0"])
def test_every_e4m3_code_bit_exact_against_spec(scale_kind):
    """One code per row (every non-NaN code, at a different column, the rest zero codes): each output is
    a single product, so every implementation must give the spec's bits exactly (gemv and gemm)."""
    rng = np.random.default_rng(11)
    codes = E4M3_CODES["random"]
    rows, cols = len(codes), 300
    data = np.zeros((rows, cols), np.uint8)
    data[np.arange(rows), (np.arange(rows) * 37) % cols] = codes
    grid = (-(-rows // 128), -(-cols // 128))
    scale = (rng.integers(110, 130, size=grid).astype(np.uint8) if scale_kind == "e8m0"
             else rng.uniform(1e-3, 10, size=grid).astype(np.float32))
    w = native.Weight(data, "e4m3", scale, (128, 128))
    x = (rng.standard_normal((5, cols)) * np.exp(rng.uniform(-20, 20, size=(5, cols)))).astype(np.float32)
    native.init("scalar")
    want_v, want_m = native.gemv(w, x[0]), native.gemm(w, x)
    native.init("")
    for isa in native.available_isas():
        native.init(isa)
        try:
            assert np.array_equal(native.gemv(w, x[0]).view(np.uint32), want_v.view(np.uint32)), f"gemv {isa}"
            assert np.array_equal(native.gemm(w, x).view(np.uint32), want_m.view(np.uint32)), f"gemm {isa}"
        finally:
            native.init("")


def test_decode_operands_bad_names():
    for which in ("scalar", "avx2:e5m2", "sse9:e4m3", "amx:", "scalar:e2m1"):   # e2m1 multiplies integers
        isa, _, fmt = which.partition(":")
        with pytest.raises(CpumlaError):
            native.decode_operands(isa, fmt)
