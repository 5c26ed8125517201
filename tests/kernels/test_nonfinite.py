"""Non-finite values are never hidden by a format conversion, on every implementation this machine runs:
cpumla_quantize gives a block holding a NaN or an infinity a NaN scale and zero codes (cpumla.h), and the
integer products (q8, q4, FP4) give NaN for a token whose activation block holds one (kernels.h), gemv
and gemm alike, whichever tile or FMA form serves the token count."""

from __future__ import annotations

import numpy as np
import pytest

from cpumla import native

from support import reference as ref

BAD = (np.nan, np.inf, -np.inf)
QK = 32


def _with_bad_values(rng, rows, cols):
    """random rows with a NaN, +inf or -inf in three blocks of each row (any lane), a whole NaN block,
    and a NaN beside a larger finite value: (values, which blocks hold one)"""
    v = rng.standard_normal((rows, cols)).astype(np.float32)
    bad = np.zeros((rows, cols // QK), bool)
    for r in range(rows):
        for k, b in enumerate(rng.choice(cols // QK, 3, replace=False)):
            v[r, QK * b + rng.integers(0, QK)] = BAD[(r + k) % 3]
            bad[r, b] = True
    v[0, :QK] = np.nan
    bad[0, 0] = True
    v[1, QK + 3], v[1, QK + 4] = np.nan, 1e4
    bad[1, 1] = True
    return v, bad


@pytest.mark.parametrize("src", ["f32", "bf16", "f16"])
@pytest.mark.parametrize("fmt", ["q8", "q4"])
def test_quantize_keeps_nonfinite_blocks(isa, src, fmt):
    """37 blocks a row (two groups of 16 and a tail, so every lane of the 16-block max trees), bit for bit
    against the definition; the blocks holding a bad value dequantize to NaN, every other block to
    finite values."""
    rng = np.random.default_rng(7)
    rows, cols = 11, QK * 37
    v, bad = _with_bad_values(rng, rows, cols)
    data = {"f32": v, "f16": v.astype(np.float16), "bf16": ref.bf16_bits(v)}[src]
    values = ref.dequant(src, data, None, None).astype(np.float32)
    want_data, want_scale = ref.quantize_ref(fmt, values)
    q = native.quantize(native.Weight(data, src), fmt)
    np.testing.assert_array_equal(q.scale.view(np.uint16), want_scale.view(np.uint16))
    np.testing.assert_array_equal(q.data, want_data)
    back = native.dequant(q).reshape(rows, -1, QK)
    assert np.isnan(back[bad]).all(), f"{fmt} {isa}: a bad block dequantized to finite values"
    assert np.isfinite(back[~bad]).all(), f"{fmt} {isa}: a good block lost"


def _weight(fmt, rows, cols, rng):
    if fmt == "q8_0":              # GGUF's Q8_0, as its own package writes it
        gguf = pytest.importorskip("gguf")
        a = rng.standard_normal((rows, cols)).astype(np.float32)
        return native.Weight(gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0).copy(), "q8_0")
    if fmt == "e2m1":
        nib = rng.integers(0, 16, (rows, cols))
        data = (nib[:, 0::2] | (nib[:, 1::2] << 4)).astype(np.uint8)
        return native.Weight(data, "e2m1", rng.integers(118, 134, (rows, cols // QK)).astype(np.uint8), (1, QK))
    data, scale, _ = ref.make_q_weight(fmt, rows, cols, rng)
    return native.Weight(data, fmt, scale)


@pytest.mark.parametrize("fmt", ["q8", "q4", "e2m1", "q8_0"])
def test_nonfinite_activation_gives_nan(isa, fmt):
    """Tokens with a NaN, +inf or -inf in one block (any block, any lane) give NaN in every output row;
    the other tokens of the same call are unchanged. Token counts below and above the integer tiles'
    and the FP4 FMA gemm's thresholds (AMX from 16, FMA from 12 or 40)."""
    rng = np.random.default_rng(3)
    rows, cols = 37, QK * 17
    w = _weight(fmt, rows, cols, rng)
    for n in (1, 5, 20, 48):
        x = rng.standard_normal((n, cols)).astype(np.float32)
        clean = native.gemm(w, x)
        assert np.isfinite(clean).all()
        hit = np.arange(n) % 3 == 0
        xb = x.copy()
        for t in np.flatnonzero(hit):
            xb[t, QK * (t % 17) + t % QK] = BAD[t % 3]
        got = native.gemm(w, xb)
        assert np.isnan(got[hit]).all(), f"{fmt} {isa} n={n}: a bad token's row came out finite"
        np.testing.assert_allclose(got[~hit], clean[~hit], rtol=1e-6, atol=1e-6)
        for t in np.flatnonzero(hit)[:3]:
            assert np.isnan(native.gemv(w, xb[t])).all(), f"{fmt} {isa}: gemv of token {t}"


@pytest.mark.parametrize("fmt", ["e4m3", "bf16", "f16"])
def test_nonfinite_weights_reach_every_product(isa, fmt):
    """A NaN weight (E4M3's codes 0x7f / 0xff; a bf16 / f16 NaN) makes its row NaN in gemv and gemm,
    its columns NaN in gemv_t and its value NaN in dequant, wherever it sits: inside the 32-column steps
    of the vector loops or in their tails; the other rows are finite."""
    rng = np.random.default_rng(9)
    rows, cols = 9, 256 + 7
    where = [(1, 5), (2, 200), (4, 260), (7, 31)]
    if fmt == "e4m3":
        data = rng.integers(0, 0x7E, (rows, cols)).astype(np.uint8) | (rng.integers(0, 2, (rows, cols)) << 7).astype(np.uint8)
        for k, (r, c) in enumerate(where):
            data[r, c] = 0x7F if k % 2 else 0xFF
        w = native.Weight(data, "e4m3", np.ones((1, 3), np.float32), (128, 128))
    else:
        v = rng.standard_normal((rows, cols)).astype(np.float32)
        for r, c in where:
            v[r, c] = np.nan
        w = native.Weight(v.astype(np.float16) if fmt == "f16" else ref.bf16_bits(v), fmt)
    bad = np.zeros(rows, bool)
    bad[[r for r, _ in where]] = True
    x = rng.standard_normal((20, cols)).astype(np.float32)
    for y in (native.gemv(w, x[0]), *native.gemm(w, x)):
        assert (np.isnan(y) == bad).all(), f"{fmt} {isa}: NaN rows {np.flatnonzero(np.isnan(y))}, want {np.flatnonzero(bad)}"
    dq = native.dequant(w)
    assert np.isnan(dq).sum() == len(where) and all(np.isnan(dq[r, c]) for r, c in where)
    t = native.head_gemv_t(w, 0, rows, rows, rng.standard_normal((1, 1, rows)).astype(np.float32))[0, 0]
    assert np.isnan(t).sum() == len({c for _, c in where}), f"{fmt} {isa}: gemv_t"
