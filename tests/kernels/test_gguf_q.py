"""GGUF's Q8_0 weights read in place (cpumla.h, kernels.h): every level's gemv / gemm bit for bit the
spec's arithmetic written out in numpy (the activations quantized per block of 32 to int8, exact block
sums, (float)isum * (d * xd) added in block order in fp32); dequant equal to the gguf package's;
the MLA absorb (head_gemv_t) against float64."""

from __future__ import annotations

import numpy as np
import pytest

from cpumla import native
from cpumla.errors import CpumlaError

gguf = pytest.importorskip("gguf")
Q8_0 = gguf.GGMLQuantizationType.Q8_0


def q8_0(rows, cols, seed=0, extremes=True):
    """Q8_0 blocks of random values from the gguf package's quantizer, then (extremes) some codes set to
    -128 and 127 and a zero block: what a file may hold beyond what llama.cpp writes."""
    rng = np.random.default_rng(seed)
    a = (rng.standard_normal((rows, cols)) * rng.uniform(0.01, 3, (rows, 1))).astype(np.float32)
    raw = gguf.quants.quantize(a, Q8_0).copy()
    if extremes:
        blocks = raw.reshape(rows, cols // 32, 34)
        blocks[0, 0, 2:6] = np.array([-128, 127, -128, 127], np.int8).view(np.uint8)
        blocks[-1, -1] = 0
    return raw


def spec(raw, x):
    """y[t, r] as kernels.h defines it for Q8_0, in float32 operations in the spec's order."""
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, 34)
    d = blocks[:, :, :2].copy().view(np.float16)[:, :, 0].astype(np.float32)
    q = blocks[:, :, 2:].view(np.int8).astype(np.int64)
    out = np.empty((x.shape[0], rows), np.float32)
    for t, row in enumerate(x.astype(np.float32)):
        xb = row.reshape(-1, 32)
        amax = np.abs(xb).max(1)
        big = amax >= np.float32(2.0 ** -100)
        with np.errstate(divide="ignore"):
            ident = np.where(big, np.float32(127) / amax, np.float32(0)).astype(np.float32)
        xq = np.rint(xb * ident[:, None]).astype(np.int64)
        xd = np.where(big, amax / np.float32(127), np.float32(0)).astype(np.float32)
        isum = (q * xq[None]).sum(-1).astype(np.float32)            # [rows, nb], exact
        p = isum * (d * xd[None]).astype(np.float32)
        acc = np.zeros(rows, np.float32)
        for b in range(p.shape[1]):
            acc = (acc + p[:, b]).astype(np.float32)
        out[t] = acc
    return out


@pytest.mark.parametrize("rows,cols", [(1, 32), (7, 96), (33, 288), (64, 1024)])
def test_q8_0_gemv_gemm_bit_exact(isa, rows, cols):
    raw = q8_0(rows, cols, seed=rows)
    w = native.Weight(raw, "q8_0")
    assert (w.rows, w.cols) == (rows, cols)
    rng = np.random.default_rng(cols)
    x = rng.standard_normal((21, cols)).astype(np.float32)          # 21 tokens: the panels (from 16) too
    x[1, :32] = 0.0                                                  # a zero activation block
    x[2, 32:] *= 1e-3
    want = spec(raw, x)
    assert np.array_equal(native.gemv(w, x[0]), want[0])
    assert np.array_equal(native.gemm(w, x), want)
    assert native.kernel_impl("gemv:q8_0") == {"scalar": "scalar", "avx2": "avx2", "avxvnni": "avx2",
                                               "avx512f": "avx2"}.get(isa, "avx512vnni" if isa != "neon" else "neon")


def test_q8_0_strided_rows_and_dequant(isa):
    """Rows of a bigger tensor (an expert of a stacked one, rows strided) and dequant against gguf's."""
    raw = q8_0(3 * 16, 128, seed=3).reshape(3, 16, -1)
    w = native.Weight(raw[1][::2], "q8_0")
    x = np.random.default_rng(1).standard_normal((2, 128)).astype(np.float32)
    assert np.array_equal(native.gemm(w, x), spec(raw[1][::2], x))
    ref = gguf.quants.dequantize(raw[1][::2], Q8_0)
    assert np.array_equal(native.dequant(w), ref)


def test_q8_0_absorb(isa):
    """head_gemv_t (MLA's absorb through kv_b) in fp32 against float64 on the dequantized values;
    head_gemv (the un-absorb) bit for bit the spec per head."""
    H, dn, dv, R = 4, 32, 32, 64
    raw = q8_0(H * (dn + dv), R, seed=5)
    w = native.Weight(raw, "q8_0")
    dense = gguf.quants.dequantize(raw, Q8_0).astype(np.float64)
    x = np.random.default_rng(2).standard_normal((3, H, dn)).astype(np.float32)
    got = native.head_gemv_t(w, 0, dn + dv, dn, x)
    ref = np.einsum("thd,hdr->thr", x.astype(np.float64), dense.reshape(H, dn + dv, R)[:, :dn])
    assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max()
    lat = np.random.default_rng(4).standard_normal((3, H, R)).astype(np.float32)
    got = native.head_gemv(w, dn, dn + dv, dv, lat)                   # the un-absorb: integer products
    for h in range(H):
        rows = raw[h * (dn + dv) + dn:(h + 1) * (dn + dv)]
        assert np.array_equal(got[:, h], spec(rows, lat[:, h]))


@pytest.mark.parametrize("data,words", [
    (np.zeros((4, 33), np.uint8), "whole 34-byte blocks"),
    (np.zeros((4, 0), np.uint8), "whole 34-byte blocks"),
    (np.zeros((4, 34), np.int16), "1-byte elements"),
])
def test_q8_0_bad_weight(data, words):
    with pytest.raises(CpumlaError, match=words):
        native.Weight(data, "q8_0")
    with pytest.raises(CpumlaError, match="no scale grid"):
        native.Weight(np.zeros((4, 34), np.uint8), "q8_0", scale=np.zeros((4, 1), np.float16))
