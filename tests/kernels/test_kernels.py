"""The kernel case table, run over every implementation this machine can run, against independent
float64 references (tests/support/reference.py). Buffers past the valid data are poisoned with NaN so an
out-of-bounds read shows up as a NaN in the result."""

from __future__ import annotations

import numpy as np
import pytest

from cpumla import native
from cpumla.errors import CpumlaError

from support import reference as ref

RNG_SEED = 1234

# (format, scale kind, rows, cols): odd sizes, partial FP8 blocks ([200,300] has a [2,3] grid whose
# last blocks are partial; [576,300] is the kv_a_proj_with_mqa shape class), tails of every width.
LINEAR_CASES = [
    ("f32", None, 37, 53), ("f32", None, 256, 512),
    ("bf16", None, 1, 7), ("bf16", None, 45, 77), ("bf16", None, 130, 2048),
    ("bf16", None, 70, 4133),                     # K past avx512.c's 2048-column chunks, odd tail
    ("f16", None, 33, 65), ("f16", None, 64, 256),
    ("e4m3", "f32", 200, 300), ("e4m3", "e8m0", 200, 300), ("e4m3", "f32", 576, 300),
    ("e4m3", "f32", 17, 129), ("e4m3", "e8m0", 256, 256),
    ("e2m1", "e8m0", 19, 64), ("e2m1", "e8m0", 40, 96), ("e2m1", "e8m0", 64, 2048),
]


def case_id(c):
    return f"{c[0]}{'-' + c[1] if c[1] else ''}-{c[2]}x{c[3]}"


@pytest.mark.parametrize("case", LINEAR_CASES, ids=case_id)
def test_gemv(isa, case, gemv_prefetch):
    rng = np.random.default_rng(RNG_SEED)
    w, W = ref.build(*case, rng, strided=True)
    x = rng.standard_normal(case[3]).astype(np.float32)
    y = native.gemv(w, x)
    want, mag = W(x)                  # the activation operand of each format (kernels.h)
    ref.assert_close(y, want, mag, what=f"gemv {isa}")


@pytest.mark.parametrize("case", LINEAR_CASES, ids=case_id)
@pytest.mark.parametrize("n", [1, 3, 17])
def test_gemm(isa, case, n):
    rng = np.random.default_rng(RNG_SEED + n)
    w, W = ref.build(*case, rng)
    xbig = np.full((n, case[3] + 5), np.nan, np.float32)      # strided rows, NaN past the width
    xbig[:, : case[3]] = rng.standard_normal((n, case[3]))
    x = xbig[:, : case[3]]
    y = native.gemm(w, x)
    want, mag = W(x)
    ref.assert_close(y, want, mag, what=f"gemm {isa}")


@pytest.mark.parametrize("n", [1, 3, 70])
def test_gemm_f32act_keeps_activations(isa, n):
    """The router's product: bf16 weights times x unrounded, to fp32 accuracy (cpumla_gemm_f32act),
    where gemm rounds x to bf16 (~2^-9 relative: far outside this tolerance). n = 70 passes its
    64-token chunks."""
    rng = np.random.default_rng(5)
    w, W = ref.build("bf16", None, 40, 300, rng)
    xbig = np.full((n, 305), np.nan, np.float32)
    xbig[:, :300] = rng.standard_normal((n, 300)) * np.exp(rng.uniform(-8, 8, (n, 300)))
    x = xbig[:, :300]
    want = x.astype(np.float64) @ W.W.T
    ref.assert_close(native.gemm_f32act(w, x), want, np.abs(x) @ np.abs(W.W).T, rtol=2e-6, what=f"f32act {isa}")
    assert np.abs(native.gemm(w, x) - want).max() > 1e-4 * np.abs(want).max()     # gemm does round


@pytest.mark.parametrize("case", LINEAR_CASES, ids=case_id)
def test_dequant_exact(isa, case):
    rng = np.random.default_rng(RNG_SEED)
    w, W = ref.build(*case, rng)
    np.testing.assert_array_equal(native.dequant(w), W.W.astype(np.float32))


@pytest.mark.parametrize("fmt,scale_kind", [("f32", None), ("bf16", None), ("e4m3", "f32"), ("e4m3", "e8m0")])
@pytest.mark.parametrize("n", [1, 4])
def test_head_gemv_absorb_unabsorb(isa, fmt, scale_kind, n):
    """kv_b_proj [H*(dn+dv), R]: absorb q~_h = q_nope_h @ W_UK[h], un-absorb o_h = W_UV[h] o_lat_h."""
    H, dn, dv, R = 5, 24, 20, 136
    rng = np.random.default_rng(7)
    w, W = ref.build(fmt, scale_kind, H * (dn + dv), R, rng)
    q = np.full((n, H, dn + 3), np.nan, np.float32)              # strided heads, NaN past dn
    q[:, :, :dn] = rng.standard_normal((n, H, dn))
    q_nope = q[:, :, :dn]
    got = native.head_gemv_t(w, 0, dn + dv, dn, q_nope)
    for h in range(H):                                           # rows of W_UK[h]
        p = W.terms_t(q_nope[:, h], slice(h * (dn + dv), h * (dn + dv) + dn))     # [n, dn, R]
        ref.assert_close(got[:, h], p.sum(1), np.abs(p).sum(1), what=f"absorb {isa} head {h}")
    o_lat = rng.standard_normal((n, H, R)).astype(np.float32)
    got = native.head_gemv(w, dn, dn + dv, dv, o_lat)
    for h in range(H):                                           # rows of W_UV[h]
        p = W.terms(o_lat[:, h], slice(h * (dn + dv) + dn, (h + 1) * (dn + dv)))   # [n, dv, R]
        ref.assert_close(got[:, h], p.sum(-1), np.abs(p).sum(-1), what=f"un-absorb {isa} head {h}")


@pytest.mark.parametrize("wkind", [None, "f32", "bf16"])
@pytest.mark.parametrize("dim", [7, 64, 513])
def test_rmsnorm(isa, wkind, dim):
    rng = np.random.default_rng(dim)
    xbig = np.full((5, dim + 3), np.nan, np.float32)
    xbig[:, :dim] = rng.standard_normal((5, dim)) * 3
    x = xbig[:, :dim]
    wv = rng.standard_normal(dim).astype(np.float32)
    weight = None if wkind is None else (wv if wkind == "f32" else ref.bf16_bits(wv))
    wref = None if wkind is None else (wv.astype(np.float64) if wkind == "f32" else ref.bf16_value(weight))
    want = ref.rms_norm(x, wref, 1e-6)
    ref.assert_close(native.rmsnorm(x, weight, 1e-6), want, np.abs(want) + 1e-6, rtol=1e-5, what="rmsnorm")
    y = x.copy()                                                 # in place
    native.rmsnorm(y, weight, 1e-6, out=y)
    ref.assert_close(y, want, np.abs(want) + 1e-6, rtol=1e-5, what="rmsnorm in place")


@pytest.mark.parametrize("mode", ["interleaved", "half", "interleaved-inverse"])
def test_rope(isa, mode):
    rng = np.random.default_rng(3)
    n, H, d, offset, rd = 4, 3, 40, 16, 24           # rope on the last 24 of 40 dims (MLA: q_pe last)
    x = rng.standard_normal((n, H, d)).astype(np.float32)
    pos = np.array([0, 1, 17, 4000])
    inv_freq = (10000.0 ** (-np.arange(0, rd, 2) / rd)).astype(np.float32)
    flag = {"interleaved": 0, "half": 1, "interleaved-inverse": 2}[mode]
    want = ref.rope(x, pos, inv_freq, offset, rd, mode == "half", "inverse" in mode)
    got = native.rope(x.copy(), pos, inv_freq, offset, rd, flag)
    ref.assert_close(got, want, np.abs(x).max() * np.ones_like(want), rtol=1e-5, what="rope")
    back = native.rope(got, pos, inv_freq, offset, rd, flag ^ 2)   # the inverse undoes it
    ref.assert_close(back, x, np.ones_like(want), rtol=1e-4, what="rope inverse")


@pytest.mark.parametrize("limit", [0.0, 10.0])
def test_swiglu(isa, limit):
    rng = np.random.default_rng(5)
    gu = (rng.standard_normal((6, 2 * 37)) * 8).astype(np.float32)   # [gate | up] rows, values past 10
    gate, up = gu[:, :37], gu[:, 37:]
    g, u = gate.astype(np.float64), up.astype(np.float64)
    if limit > 0:
        g, u = np.minimum(g, limit), np.clip(u, -limit, limit)
    want = g / (1 + np.exp(-g)) * u
    ref.assert_close(native.swiglu(gate, up, limit), want, np.abs(want) + 1e-6, rtol=1e-5, what="swiglu")


def test_softmax(isa):
    rng = np.random.default_rng(9)
    x = (rng.standard_normal((4, 133)) * 10).astype(np.float32)
    x[1, 5] = -np.inf
    x[2, :] += 80.0                                               # large values: needs the max shift
    want = np.exp(x - x.max(1, keepdims=True))
    want /= want.sum(1, keepdims=True)
    ref.assert_close(native.softmax(x.copy()), want, want + 1e-7, rtol=1e-5, what="softmax")


def test_topk_ties_and_nan():
    x = np.array([1, 5, 3, 5, np.nan, -1, 5, 2], np.float32)
    idx, val = native.topk(x, 4)
    assert idx.tolist() == [1, 3, 6, 2] and val.tolist() == [5, 5, 5, 3]
    rng = np.random.default_rng(0)
    y = rng.standard_normal(300).astype(np.float32)
    idx, _ = native.topk(y, 8)
    assert idx.tolist() == np.argsort(-y, kind="stable")[:8].tolist()


@pytest.mark.parametrize("cache_kind", ["f32", "bf16"])
def test_cache_store(isa, cache_kind):
    rng = np.random.default_rng(11)
    width, ld_ = 40, 48
    cache = np.full((10, ld_), np.nan, np.float32) if cache_kind == "f32" else np.full((10, ld_), 0x7FC0, np.uint16)
    src = rng.standard_normal((4, width)).astype(np.float32)
    native.cache_store(cache, src, np.array([3, -1, 0, 9]))
    stored = cache.astype(np.float64) if cache_kind == "f32" else ref.bf16_value(cache)
    want_rows = src if cache_kind == "f32" else ref.bf16_value(ref.bf16_bits(src))
    for slot, t in [(3, 0), (0, 2), (9, 3)]:
        np.testing.assert_array_equal(stored[slot, :width], want_rows[t])
    untouched = [r for r in range(10) if r not in (0, 3, 9)]
    assert np.isnan(stored[untouched]).all() and np.isnan(stored[:, width:]).all()


ATTN_CASES = [
    # name, n_q, H, dk, dv, T(valid), causal, sparse, sinks, cache
    ("decode-mla", 1, 16, 80, 64, 300, False, False, False, "f32"),
    ("decode-mla-bf16", 1, 20, 80, 64, 1000, False, False, False, "bf16"),
    ("decode-short", 1, 3, 24, 16, 5, False, False, False, "f32"),
    ("prefill-causal", 9, 5, 80, 64, 9, True, False, False, "f32"),
    ("sparse-idx", 3, 4, 48, 48, 200, False, True, False, "bf16"),
    ("v4-sinks", 2, 6, 64, 64, 150, False, False, True, "f32"),
    ("decode-sinks-empty", 1, 4, 32, 32, 0, False, False, True, "f32"),
]


@pytest.mark.parametrize("case", ATTN_CASES, ids=lambda c: c[0])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_mla_attention(isa, case, threads):
    name, n_q, H, dk, dv, T, causal, sparse, with_sinks, cache_kind = case
    rng = np.random.default_rng(hash(name) % 1000)
    native.set_threads(threads)
    try:
        ld_kv, T_alloc = dk + 8, T + 16
        kv = np.full((T_alloc, ld_kv), np.nan, np.float32)           # NaN past n_kv and past dk
        kv[:T, :dk] = rng.standard_normal((T, dk))
        kv_ref = kv.astype(np.float64)
        if cache_kind == "bf16":
            kv_c = ref.bf16_bits(kv)
            kv_ref = ref.bf16_value(kv_c)
        else:
            kv_c = kv
        qbig = np.full((n_q, H, dk + 4), np.nan, np.float32)
        qbig[:, :, :dk] = rng.standard_normal((n_q, H, dk))
        q = qbig[:, :, :dk]
        scale = dk ** -0.5
        kv_len = kv_idx = None
        if causal:
            kv_len = np.arange(1, n_q + 1)
            rows = [list(range(k)) for k in kv_len]
        elif sparse:
            kv_idx = rng.integers(0, T, size=(n_q, 40)).astype(np.int32)
            kv_idx[:, ::7] = -1
            kv_len = np.array([40, 13, 0])
            rows = [[r for r in kv_idx[i, : kv_len[i]] if r >= 0] for i in range(n_q)]
        else:
            rows = [list(range(T))] * n_q
        sinks = rng.standard_normal(H).astype(np.float32) if with_sinks else None
        out, lse = native.mla_attention(q, kv_c[:T], dk, dv, scale,     # T = 0: no row at all
                                        kv_len=kv_len, kv_idx=kv_idx, sinks=sinks, want_lse=True)
        want, want_lse = ref.attention(q.astype(np.float64), kv_ref, dk, dv, scale, rows, sinks)
        vmag = np.abs(kv_ref[:T, :dv]).max() if T else 1.0
        ref.assert_close(out, want, np.full(want.shape, vmag), rtol=1e-5, what=f"attention {name}")
        finite = np.isfinite(want_lse)
        assert (np.isfinite(lse) == finite).all()
        ref.assert_close(lse[finite], want_lse[finite], np.abs(want_lse[finite]) + 1, rtol=1e-5, what="lse")
    finally:
        native.set_threads(None)


def test_read_probe(isa):
    buf = np.arange(1 << 16, dtype=np.float64)                  # exact sums
    assert native.read_probe(buf) == float(buf.sum())


@pytest.mark.parametrize("kind,depth", [(0, 32), (1, 64)], ids=["bf16", "int8"])
def test_tile_probe_counts_the_tile_products_of_every_thread(isa, kind, depth):
    """4 products of 16 x 16 x depth multiply-adds a round on each thread where the level has tiles;
    nothing below it."""
    from cpumla.native.library import lib

    threads = native.get_threads()
    ops = lib.cpumla_tile_probe(kind, 100)
    assert ops == (threads * 100 * 4 * 2 * 16 * 16 * depth if isa == "amx" else 0)
    assert lib.cpumla_tile_probe(2, 100) == 0 and lib.cpumla_tile_probe(kind, 0) == 0


def test_bad_weights_are_errors():
    rng = np.random.default_rng(0)
    q, s, _ = ref.make_weight("e4m3", 200, 300, rng)
    with pytest.raises(CpumlaError, match="scale grid"):
        native.Weight(q, "e4m3", s[:1])
    with pytest.raises(CpumlaError, match="needs a scale"):
        native.Weight(q, "e4m3")
    with pytest.raises(CpumlaError, match="unknown weight dtype"):
        native.Weight(q, "int3")


@pytest.mark.parametrize("fmt", ["f32", "bf16", "e4m3"])
@pytest.mark.parametrize("n", [1, 7])
def test_moe(isa, fmt, n):
    """cpumla_moe against per-token float64 SwiGLU experts, with a skipped (-1) slot."""
    rng = np.random.default_rng(21)
    E, D, I, k = 5, 48, 40, 3
    raw = [[ref.build(fmt, "f32", r, c, rng) for r, c in ((I, D), (I, D), (D, I))] for _ in range(E)]
    table = native.Experts([tuple(wt for wt, _ in ex) for ex in raw])
    x = rng.standard_normal((n, D)).astype(np.float32)
    idx = rng.integers(0, E, size=(n, k)).astype(np.int32)
    idx[0, 1] = -1
    w = rng.uniform(0.1, 1.0, size=(n, k)).astype(np.float32)
    y0 = rng.standard_normal((n, D)).astype(np.float32)
    got = table(x, idx, w, y0.copy())
    want = y0.astype(np.float64)
    mag = np.abs(want)
    for t in range(n):
        for j in range(k):
            if idx[t, j] < 0:
                continue
            G, U, Dn = (m for _, m in raw[idx[t, j]])
            g, u = G(x[t])[0], U(x[t])[0]
            d, dmag = Dn((g / (1 + np.exp(-g)) * u).astype(np.float32))
            want[t] += w[t, j] * d
            mag[t] += w[t, j] * dmag
    ref.assert_close(got, want, mag + 1e-3, rtol=5e-5, what="moe")
    with pytest.raises(CpumlaError, match="out of range"):
        table(x, np.full((n, k), E, np.int32), w, y0.copy())
