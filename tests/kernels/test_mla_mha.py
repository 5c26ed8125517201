"""MLA attention in the un-absorbed form (cpumla_mla_mha): the kernel on every implementation against a
float64 reference (keys and values decompressed with kernels.h's products, then plain softmax
attention), and its argument checks. The forward that sends prefill chunks through it:
tests/models/test_mla_unabsorbed.py."""

from __future__ import annotations

import numpy as np
import pytest

from cpumla import native
from cpumla.errors import CpumlaError

from support import reference as ref

# (name, n_q, H, R, P, dn, dv, pos0, cache, kv_b format, kv_len): odd widths everywhere; 270 queries at
# depth 300 cross the 256-row key blocks and the 256-query score blocks; 4200 rows cross a span.
CASES = [
    ("causal-f32", 270, 3, 40, 6, 10, 7, 300, "f32", "f32", "causal"),
    ("causal-bf16", 270, 3, 40, 6, 10, 7, 300, "bf16", "bf16", "causal"),
    ("f32-cache-bf16-kv_b", 37, 2, 33, 4, 9, 12, 263, "f32", "bf16", "causal"),
    ("bf16-cache-f32-kv_b", 37, 2, 33, 4, 9, 12, 263, "bf16", "f32", "causal"),
    ("e4m3-kv_b", 20, 2, 48, 4, 8, 8, 50, "f32", "e4m3", "causal"),
    ("every-row", 5, 4, 16, 2, 6, 5, 40, "bf16", "bf16", "all"),
    ("ragged", 11, 2, 24, 4, 8, 6, 30, "f32", "bf16", "ragged"),
    ("span", 3, 1, 32, 4, 8, 8, 4200, "bf16", "bf16", "causal"),
]


def reference(q, lat, W, R, dn, dv, scale, kv_len):
    """float64 attention with keys [W_UK c | k_pe] and values W_UV c from W's products (ref.Linear)."""
    n_q, H, dk = q.shape
    Y, _ = W(lat[:, :R].astype(np.float32))                     # [T, H * (dn + dv)]
    out = np.zeros((n_q, H, dv))
    vmag = 0.0
    for h in range(H):
        K = np.concatenate([Y[:, h * (dn + dv):h * (dn + dv) + dn], lat[:, R:]], axis=1)
        V = Y[:, h * (dn + dv) + dn:(h + 1) * (dn + dv)]
        vmag = max(vmag, np.abs(V).max())
        for i in range(n_q):
            c = min(kv_len[i], len(lat))
            if c <= 0:
                continue
            s = q[i, h].astype(np.float64) @ K[:c].T * scale
            p = np.exp(s - s.max())
            out[i, h] = p @ V[:c] / p.sum()
    return out, vmag


@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_mla_mha(isa, case, threads):
    name, n_q, H, R, P, dn, dv, pos0, cache, fmt, kind = case
    rng = np.random.default_rng(sum(map(ord, name)))
    native.set_threads(threads)
    try:
        data, scale, block = ref.make_weight(fmt, H * (dn + dv), R, rng)
        if fmt == "f32":
            data *= 0.3
        w, W = native.Weight(data, fmt, scale, block), ref.Linear(fmt, data, scale, block)
        T = pos0 + n_q
        kv = np.full((T + 8, R + P + 5), np.nan, np.float32)       # NaN past the rows and their width
        kv[:T, :R + P] = rng.standard_normal((T, R + P)) * 0.5
        kv_c = ref.bf16_bits(kv) if cache == "bf16" else kv
        lat = ref.bf16_value(kv_c).reshape(kv.shape)[:T, :R + P] if cache == "bf16" else kv[:T, :R + P].astype(np.float64)
        qbig = np.full((n_q, H, dn + P + 3), np.nan, np.float32)
        qbig[..., :dn + P] = rng.standard_normal((n_q, H, dn + P))
        q = qbig[..., :dn + P]
        if kind == "causal":
            kv_len = pos0 + np.arange(n_q) + 1
        elif kind == "all":
            kv_len = np.full(n_q, T)
        else:                                  # some queries see nothing, some past the last row
            kv_len = rng.integers(0, T + 9, n_q)
            kv_len[::3] = 0
        sm = 0.6 / np.sqrt(dn + P)
        out = native.mla_mha(q, kv_c[:T], w, R, dn, dv, sm, kv_len=None if kind == "all" else kv_len)
        want, vmag = reference(q, lat, W, R, dn, dv, sm, kv_len)
        assert np.isfinite(out).all(), "non-finite output (an out-of-bounds read?)"
        err = np.abs(out - want).max()
        assert err <= 2e-5 * (1 + vmag), f"{name}: max err {err:.3g} (|v| up to {vmag:.3g})"
        if kind == "ragged":
            assert (out[kv_len == 0] == 0).all()
    finally:
        native.set_threads(None)


def pair_weight(fmt, rows, cols, rng):
    """A weight [rows, cols] of W_UK / W_UV in a format a GGUF file may split them in."""
    a = rng.standard_normal((rows, cols)).astype(np.float32) * 0.3
    if fmt in ("f32", "f16"):
        return native.Weight(a.astype(np.float16 if fmt == "f16" else np.float32), fmt)
    if fmt == "bf16":
        return native.Weight(ref.bf16_bits(a), fmt)
    gguf = pytest.importorskip("gguf")
    raw = gguf.quants.quantize(a, gguf.GGMLQuantizationType[fmt.upper()])
    return native.Weight(raw, fmt)


# (k_b format, v_b format, cache, n_q, H, R, P, dn, dv, pos0): the split pair as GGUF files hold it
SPLIT_CASES = [
    ("q8_0", "q8_0", "f32", 270, 3, 64, 6, 32, 32, 300),
    ("q4_0", "q8_0", "bf16", 40, 2, 96, 4, 64, 32, 30),
    ("f16", "f16", "f32", 20, 3, 40, 4, 16, 24, 9),
    ("bf16", "f32", "bf16", 9, 1, 32, 2, 8, 8, 4200),
]


@pytest.mark.parametrize("case", SPLIT_CASES, ids=lambda c: "-".join(map(str, c[:3])))
@pytest.mark.parametrize("threads", [1, 3])
def test_mla_mha_split_pair(isa, case, threads):
    """kv_b NULL, W_UK and W_UV apart (k_b [H*R, dn], W_UK transposed per head; v_b [H*dv, R]) in their own
    formats: the same numbers, bit for bit, as kv_b in F32 holding their dequantized values."""
    kf, vf, cache, n_q, H, R, P, dn, dv, pos0 = case
    rng = np.random.default_rng(n_q + R)
    native.set_threads(threads)
    try:
        k_b, v_b = pair_weight(kf, H * R, dn, rng), pair_weight(vf, H * dv, R, rng)
        uk = native.dequant(k_b).reshape(H, R, dn).transpose(0, 2, 1)        # [H, dn, R]
        uv = native.dequant(v_b).reshape(H, dv, R)
        kv_b = native.Weight(np.ascontiguousarray(np.concatenate([uk, uv], 1).reshape(H * (dn + dv), R)), "f32")
        T = pos0 + n_q
        kv = (rng.standard_normal((T, R + P + 3)) * 0.5).astype(np.float32)
        kv_c = ref.bf16_bits(kv) if cache == "bf16" else kv
        q = rng.standard_normal((n_q, H, dn + P)).astype(np.float32)
        kv_len = pos0 + np.arange(n_q) + 1
        sm = 0.6 / np.sqrt(dn + P)
        want = native.mla_mha(q, kv_c, kv_b, R, dn, dv, sm, kv_len=kv_len)
        got = native.mla_mha(q, kv_c, None, R, dn, dv, sm, kv_len=kv_len, k_b=k_b, v_b=v_b)
        assert np.isfinite(want).all() and np.abs(want).max() > 0.01
        np.testing.assert_array_equal(got, want)
    finally:
        native.set_threads(None)


def test_mla_mha_bad_arguments():
    rng = np.random.default_rng(0)
    w = native.Weight(rng.standard_normal((2 * 20, 16)).astype(np.float32), "f32")
    q = np.zeros((3, 2, 12), np.float32)
    kv = np.zeros((5, 20), np.float32)
    with pytest.raises(CpumlaError, match="rank columns"):
        native.mla_mha(q, kv, w, 12, 8, 12, 1.0)               # kv_b has 16 columns
    with pytest.raises(CpumlaError, match="narrower"):
        native.mla_mha(q, kv[:, :18], w, 16, 8, 12, 1.0)       # rank 16 + rope 4 > 18
    with pytest.raises(CpumlaError, match="rows"):
        native.mla_mha(q, kv, w, 16, 8, 13, 1.0)               # 2 heads x (8 + 13) > 40 rows
    with pytest.raises(CpumlaError, match="neither kv_b nor"):
        native.mla_mha(q, kv, None, 16, 8, 12, 1.0, k_b=w)     # no v_b
    k_b = native.Weight(np.zeros((2 * 16, 8), np.float32), "f32")
    v_b = native.Weight(np.zeros((2 * 12, 16), np.float32), "f32")
    native.mla_mha(q, kv, None, 16, 8, 12, 1.0, k_b=k_b, v_b=v_b)
    with pytest.raises(CpumlaError, match="k_b must have dn columns"):
        native.mla_mha(q, kv, None, 16, 8, 12, 1.0, k_b=v_b, v_b=v_b)
    with pytest.raises(CpumlaError, match="v_b must have rank columns"):
        native.mla_mha(q, kv, None, 16, 8, 13, 1.0, k_b=k_b, v_b=v_b)     # 2 x 13 > 24 rows
