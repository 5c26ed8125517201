"""A gemm of 2 or 3 tokens (speculative decoding's verify) on the avx512 level goes row by row when its
bf16 weights' activations fit in L1 (avx512.c, gemv_row_nt), each row read once for every token: each
token's result is then the bits of its own gemv, whatever the row count and tail."""

from __future__ import annotations

import numpy as np
import pytest

from cpumla import native


@pytest.mark.parametrize("rows, cols", [(257, 512), (64, 2000), (3, 64)])
@pytest.mark.parametrize("n", [2, 3])
def test_each_token_gets_its_gemv_bit_for_bit(isa, rows, cols, n):
    if isa != "avx512":
        pytest.skip("the row-by-row path of a few tokens is the avx512 level's")
    rng = np.random.default_rng(rows + cols + n)
    a = rng.standard_normal((rows, cols)).astype(np.float32)
    w = native.Weight((a.view(np.uint32) >> 16).astype(np.uint16), "bf16")
    x = rng.standard_normal((n, cols)).astype(np.float32)
    y = native.gemm(w, x)
    for t in range(n):
        np.testing.assert_array_equal(y[t], native.gemv(w, x[t]))
