"""A gemm of 2 or 3 tokens (speculative decoding's verify) reads each row once for every token where a level
has a row-by-row path for it: the avx512 level's bf16 when the activations fit in L1 (avx512.c,
gemv_row_nt), the avx2 level's plain and FP8 weights (avx2.c, cpumla_avx2_gemm_few) and the integer
products of int_avx2.h's levels (quant_driver.h's gemv_rows). Each token's result is then the bits of its
own gemv, whatever the row count, the tail and the NaN codes: a verify forward and plain decode agree."""

from __future__ import annotations

import numpy as np
import pytest

from cpumla import native
from cpumla.bench.kernels import random_weight

# the formats each level serves row by row at 2 and 3 tokens
FORMATS = ["f32", "bf16", "f16", "e4m3", "e4m3-e8m0", "q8", "q4", "e2m1"]
ROW_BY_ROW = {"avx512": {"bf16"}, "avx2": set(FORMATS), "avxvnni": set(FORMATS)}   # avxvnni: avx2's floats
SHAPES = [(257, 512), (64, 2000), (3, 64), (130, 1408)]


@pytest.mark.parametrize("rows, cols", SHAPES)
@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("fmt", FORMATS)
def test_each_token_gets_its_gemv_bit_for_bit(isa, fmt, rows, cols, n):
    if fmt not in ROW_BY_ROW.get(isa, ()):
        pytest.skip(f"{isa} has no row-by-row path of a few tokens for {fmt}")
    if fmt in ("q8", "q4", "e2m1") and cols % 32:
        pytest.skip("the integer formats' rows are whole blocks of 32")
    rng = np.random.default_rng(rows + cols + n)
    w = random_weight(fmt, rows, cols, rng)
    x = rng.standard_normal((n, cols)).astype(np.float32)
    x[-1, :7] = [0.0, 1e-30, -1e-30, 3e4, -3e4, 0.0, 1e-3]     # zeros, tiny and large activations
    y = native.gemm(w, x)
    want = np.stack([native.gemv(w, x[t]) for t in range(n)])
    np.testing.assert_array_equal(y, want)
    ref = x.astype(np.float64) @ native.dequant(w).astype(np.float64).T    # and the product itself
    np.testing.assert_allclose(y, ref, rtol=0, atol=2e-2 * np.abs(ref).max())


@pytest.mark.parametrize("n", [2, 3])
def test_fp8_nan_codes_stay_in_their_rows(isa, n):
    """A NaN code (0x7f / 0xff) gives NaN in its row, for every token, and nowhere else; in the columns
    past the last step of 32 too."""
    if "e4m3" not in ROW_BY_ROW.get(isa, ()):
        pytest.skip(f"{isa} has no row-by-row path of a few tokens for e4m3")
    rng = np.random.default_rng(n)
    rows, cols = 40, 263
    q = rng.integers(0, 0x7e, size=(rows, cols), dtype=np.uint8) | (rng.integers(0, 2, size=(rows, cols), dtype=np.uint8) << 7)
    q[5, 70], q[17, 260], q[30, 0] = 0x7f, 0xff, 0xff
    w = native.Weight(q, "e4m3", rng.uniform(1e-3, 1e-2, size=(1, 3)).astype(np.float32))
    x = rng.standard_normal((n, cols)).astype(np.float32)
    y = native.gemm(w, x)
    assert np.isnan(y[:, [5, 17, 30]]).all()
    assert not np.isnan(np.delete(y, [5, 17, 30], axis=1)).any()
    for t in range(n):
        np.testing.assert_array_equal(y[t], native.gemv(w, x[t]))
