"""cpumla's q8 / q4 formats: the kernels (gemv, gemm, absorb / un-absorb, dequant) over every
implementation this machine runs against the float64 references of tests/support/reference.py (the activation
quantization of kernels.h done in numpy float32, exact integer block sums), cpumla_quantize against
its definition in cpumla.h, and the Weight checks."""

from __future__ import annotations

import os
import re

import numpy as np
import pytest

from cpumla import native
from cpumla.errors import CpumlaError

from support import reference as ref

# (format, rows, cols): one block, odd block counts (tails of every step width: 1..7 blocks past a
# multiple of 8), V2-Lite's expert width 1408 (44 blocks), a long row
Q_CASES = [(f, r, c) for f in ("q8", "q4") for r, c in
           [(1, 32), (5, 64), (37, 96), (9, 224), (64, 288), (130, 1408), (17, 7168)]]


def qid(c):
    return f"{c[0]}-{c[1]}x{c[2]}"


def build(fmt, rows, cols, rng, strided=False):
    data, scale, codes = ref.make_q_weight(fmt, rows, cols, rng)
    if strided:          # rows of a bigger tensor
        big = np.zeros((data.shape[0], data.shape[1] + 40), data.dtype)
        big[:, : data.shape[1]] = data
        data = big[:, : data.shape[1]]
    return native.Weight(data, fmt, scale), ref.QLinear(codes, scale)


@pytest.mark.parametrize("case", Q_CASES, ids=qid)
def test_gemv_q(isa, case, gemv_prefetch):
    rng = np.random.default_rng(11)
    w, W = build(*case, rng, strided=True)
    x = rng.standard_normal(case[2]).astype(np.float32)
    x[: min(32, case[2])] = 0.0                      # an all-zero activation block: xd = 0
    x[32:64] *= np.float32(2.0 ** -125)              # below 2^-100: counts as zero (127 / amax would overflow)
    x[64:96] *= np.float32(2.0 ** -98)               # just above: quantized as usual
    y = native.gemv(w, x)
    want, mag = W(x)
    ref.assert_close(y, want, mag, what=f"gemv {case[0]} {isa}")
    # and the product approximates W x within the activation rounding
    exact = W.W @ x.astype(np.float64)
    assert (np.abs(y - exact) <= W.error_bound(x) + 1e-5 * mag).all()


@pytest.mark.parametrize("fmt", ["q8", "q4", "e2m1", "e4m3", "bf16", "f16"])
def test_gemv_prefetch_targets_same_bits(isa, fmt):
    """The GEMV row loops prefetching into L1, into L2, and into both are separate specialisations: the
    same bits, over enough rows that each thread's stream runs past the prefetch distance, on 1 and 2
    threads."""
    rng = np.random.default_rng(5)
    rows, cols = 300, 2048
    if fmt in native.QUANT_FORMATS:
        w, _ = build(fmt, rows, cols, rng)
    else:
        data, scale, block = ref.make_weight(fmt, rows, cols, rng, "e8m0")
        w = native.Weight(data, fmt, scale, block)
    x = rng.standard_normal(cols).astype(np.float32)
    threads = native.get_threads()
    try:
        for t in (1, 2):
            native.set_threads(t)
            got = {}
            for where in ("l1", "l2", "l2+l1"):
                native.set_gemv_prefetch(where)
                got[where] = native.gemv(w, x)
            assert np.isfinite(got["l1"]).all()
            for where in ("l2", "l2+l1"):
                assert np.array_equal(got["l1"].view(np.uint32), got[where].view(np.uint32)), f"{fmt} {isa} {t} threads {where}"
    finally:
        native.set_gemv_prefetch("auto")
        native.set_threads(threads)


def test_gemv_prefetch_choice():
    """cpumla_gemv_prefetch: L2 and L1 on Intel, L2 on AMD family 19h (Zen 4's AVX-512 loops), L1
    elsewhere, unless set; an unknown target is an error and leaves the choice as it was."""
    cpuinfo = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    amd19 = bool(re.search(r"^vendor_id\s*:\s*AuthenticAMD", cpuinfo, re.M)) and \
        bool(re.search(r"^cpu family\s*:\s*25$", cpuinfo, re.M))
    intel = bool(re.search(r"^vendor_id\s*:\s*GenuineIntel", cpuinfo, re.M))
    own = "l2+l1" if intel else "l2" if amd19 else "l1"
    native.set_gemv_prefetch("auto")
    assert native.gemv_prefetch().split()[0] == own
    try:
        native.set_gemv_prefetch("l2+l1")
        assert native.gemv_prefetch() == "l2+l1 (set)"
        native.set_gemv_prefetch("l1")
        assert native.gemv_prefetch() == "l1 (set)"
        native.init("")                      # a chosen target outlives a new implementation choice
        assert native.gemv_prefetch() == "l1 (set)"
        with pytest.raises(CpumlaError, match="unknown GEMV prefetch 'l3'"):
            native.set_gemv_prefetch("l3")
        assert native.gemv_prefetch() == "l1 (set)"
    finally:
        native.set_gemv_prefetch("auto")
    assert native.gemv_prefetch().split()[0] == own


@pytest.mark.parametrize("case", Q_CASES, ids=qid)
@pytest.mark.parametrize("n", [2, 5, 33])
def test_gemm_q(isa, case, n):
    rng = np.random.default_rng(12 + n)
    w, W = build(*case, rng)
    xbig = np.full((n, case[2] + 7), np.nan, np.float32)       # strided rows, NaN past the width
    xbig[:, : case[2]] = rng.standard_normal((n, case[2])) * np.exp(rng.uniform(-3, 3, (n, 1)))
    x = xbig[:, : case[2]]
    y = native.gemm(w, x)
    want, mag = W(x)
    ref.assert_close(y, want, mag, what=f"gemm {case[0]} {isa}")


@pytest.mark.skipif("avx2" not in native.available_isas(), reason="the avx2 level needs an AVX2 CPU")
@pytest.mark.parametrize("fmt", ["q8", "q4"])
@pytest.mark.parametrize("rows, cols", [(37, 288), (130, 1408), (17, 32)])
def test_avx2_panels_are_the_gemv(fmt, rows, cols):
    """From 8 tokens the avx2 level multiplies q8 / q4 on the GGUF panels (avx2_gqp.c), adding each row's
    blocks as its gemv does: at 8 / 17 / 43 tokens (one thread: a call gets every token), with an odd
    block count (q4's activations come in pairs of blocks; a last step of fewer than 8 blocks), a zero
    token, a tiny one, a NaN, each token's row is the gemv's bit for bit (prefill and decode agree), and
    close to the float64 reference."""
    rng = np.random.default_rng(rows + cols)
    w, W = build(fmt, rows, cols, rng)
    x = rng.standard_normal((43, cols)).astype(np.float32)
    x[2] = 0.0
    x[9, 16:] *= 1e-4
    x[40, 7] = np.nan
    native.set_threads(1)
    native.init("avx2")
    try:
        got = {n: native.gemm(w, x[:n]) for n in (8, 17, 43)}
        one = np.stack([native.gemv(w, x[t]) for t in range(43)])
    finally:
        native.init("")
        native.set_threads(None)
    for n in (8, 17, 43):
        assert np.array_equal(got[n].view(np.uint32), one[:n].view(np.uint32)), f"{fmt} {rows}x{cols}, {n} tokens"
    finite = np.isfinite(x).all(axis=1)
    want, mag = W(x[finite])
    ref.assert_close(got[43][finite], want, mag, what=f"gemm {fmt} avx2 panels")


@pytest.mark.parametrize("fmt", ["q8", "q4"])
@pytest.mark.parametrize("n", [1, 4])
@pytest.mark.parametrize("shape", [(5, 24, 20, 160), (5, 24, 20, 544), (2, 70, 6, 512)])
def test_head_gemv_q_absorb_unabsorb(isa, fmt, n, shape):
    """kv_b_proj quantized: absorb (gemv_t, fp32 activations: x_i * d times the codes) and un-absorb
    (head_gemv, quantized activations). The widths: fewer than 8 blocks; two spans of 8 blocks and one
    left over; 70 rows a head (more than a chunk of 64 coefficients) with the columns of 2 heads split
    between tasks."""
    H, dn, dv, R = shape
    rng = np.random.default_rng(8)
    w, W = build(fmt, H * (dn + dv), R, rng)
    q = np.full((n, H, dn + 3), np.nan, np.float32)
    q[:, :, :dn] = rng.standard_normal((n, H, dn))
    q_nope = q[:, :, :dn]
    got = native.head_gemv_t(w, 0, dn + dv, dn, q_nope)
    for h in range(H):
        rows = W.W[h * (dn + dv): h * (dn + dv) + dn]                       # [dn, R] exact values
        p = q_nope[:, h].astype(np.float64)[:, :, None] * rows[None]      # [n, dn, R]
        ref.assert_close(got[:, h], p.sum(1), np.abs(p).sum(1), what=f"absorb {fmt} {isa} head {h}")
    o_lat = rng.standard_normal((n, H, R)).astype(np.float32)
    got = native.head_gemv(w, dn, dn + dv, dv, o_lat)
    for h in range(H):
        want, mag = W(o_lat[:, h], slice(h * (dn + dv) + dn, (h + 1) * (dn + dv)))
        ref.assert_close(got[:, h], want, mag, what=f"un-absorb {fmt} {isa} head {h}")


@pytest.mark.parametrize("fmt", ["q8", "q4", "mixed"])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_moe_q_one_token(isa, fmt, threads):
    """cpumla_moe of one token over q8 / q4 experts (one job quantizes the token once for every gate and
    up task, then each expert's SwiGLU once for its down tasks; a table mixing q8 and q4 quantizes per
    task), against float64 experts: gate and up as kernels.h computes them, down within the activation
    rounding bound of the exact product."""
    rng = np.random.default_rng(31)
    E, D, I, k = 6, 256, 160, 4
    fmts = [("q8" if e % 2 else "q4") if fmt == "mixed" else fmt for e in range(E)]
    built = [[build(fmts[e], r, c, rng) for r, c in ((I, D), (I, D), (D, I))] for e in range(E)]
    table = native.Experts([tuple(w for w, _ in ex) for ex in built])
    x = rng.standard_normal((1, D)).astype(np.float32)
    idx = np.array([[4, -1, 1, 2]], np.int32)
    wt = rng.uniform(0.2, 1.0, size=(1, k)).astype(np.float32)
    y0 = rng.standard_normal((1, D)).astype(np.float32)
    native.set_threads(threads)
    try:
        got = table(x, idx, wt, y0.copy())[0]
    finally:
        native.set_threads(None)
    want, bound = y0[0].astype(np.float64), np.zeros(D)
    for j, e in enumerate(idx[0]):
        if e < 0:
            continue
        (_, G), (_, U), (_, Dn) = built[e]
        g, u = G(x[0])[0], U(x[0])[0]
        h = g / (1 + np.exp(-g)) * u
        want += wt[0, j] * (Dn.W @ h)
        _, mag = Dn(h.astype(np.float32))
        bound += wt[0, j] * (Dn.error_bound(h.astype(np.float32)) + 1e-4 * mag)
    err = np.abs(got - want)
    assert np.isfinite(got).all() and (err <= bound).all(), f"{fmt} {isa} {threads}: worst {(err / bound).max():.3g}"


@pytest.mark.parametrize("case", Q_CASES[:7:3] + Q_CASES[7::3], ids=qid)
def test_dequant_q_exact(isa, case):
    rng = np.random.default_rng(13)
    w, W = build(*case, rng)
    np.testing.assert_array_equal(native.dequant(w), W.W.astype(np.float32))


@pytest.mark.parametrize("src", ["f32", "bf16", "f16", "e4m3"])
@pytest.mark.parametrize("fmt", ["q8", "q4"])
def test_quantize_matches_definition(isa, src, fmt):
    """cpumla_quantize on every implementation, bit for bit against cpumla.h's definition, from every
    checkpoint format, with an all-zero block, a block whose largest |v| is negative, a tie for the
    largest |v|, a huge outlier and ties at .5 after scaling."""
    rng = np.random.default_rng(21)
    rows, cols = 67, 320
    if src == "e4m3":
        data, scale, block = ref.make_weight("e4m3", rows, cols, rng, "f32")
    else:
        v = rng.standard_normal((rows, cols)) * np.exp(rng.uniform(-4, 4, (rows, 1)))
        v[0, :32] = 0.0
        v[1, 32:64] = np.linspace(-1, 0.5, 32)
        v[2, 64:96] = 0.25
        v[2, 70] = -0.25
        v[4, 32:64] = rng.standard_normal(32) * 1e-3
        v[4, 40] = 1e3
        v[5, :32] = np.arange(-16, 16) + 0.5    # halves and .5 ties after scaling
        v[6, :32] = np.arange(-16, 16) * 0.5
        data = {"f32": v.astype(np.float32), "f16": v.astype(np.float16), "bf16": ref.bf16_bits(v)}[src]
        scale = block = None
    w = native.Weight(data, src, scale, block)
    values = ref.dequant(src, data, scale, block).astype(np.float32)
    want_data, want_scale = ref.quantize_ref(fmt, values)
    q = native.quantize(w, fmt)
    np.testing.assert_array_equal(q.scale.view(np.uint16), want_scale.view(np.uint16))
    np.testing.assert_array_equal(q.data, want_data)
    # within half a step of the original (q4: one step, as +8 steps is clamped to +7; and the fp16
    # rounding of d, 2^-11 relative, can stretch the largest value to 8 (1 + 2^-11) steps)
    back = native.dequant(q).astype(np.float64)
    step = np.abs(np.repeat(q.scale.astype(np.float64), 32, axis=1))
    assert (np.abs(back - values) <= (0.5 if fmt == "q8" else 1.0 + 8 * 2.0 ** -11) * step * (1 + 1e-6)).all()


def test_quantize_rows_and_errors():
    native.init("")
    rng = np.random.default_rng(3)
    v = rng.standard_normal((40, 64)).astype(np.float32)
    w = native.Weight(v, "f32")
    full = native.quantize(w, "q8")
    data = np.zeros_like(full.data)
    scale = np.zeros_like(full.scale)
    native.quantize(w, "q8", data, scale, rows=(10, 25))
    np.testing.assert_array_equal(data[10:25], full.data[10:25])
    assert not data[:10].any() and not data[25:].any()
    with pytest.raises(CpumlaError, match="already quantized"):
        native.quantize(full, "q4")
    with pytest.raises(CpumlaError, match="unknown quantized format"):
        native.quantize(w, "q5")
    with pytest.raises(CpumlaError, match="multiple of 32"):
        native.quantize(native.Weight(v[:, :50], "f32"), "q8")


def test_weight_checks():
    q = np.zeros((4, 64), np.int8)
    s = np.zeros((4, 2), np.float16)
    native.Weight(q, "q8", s)
    with pytest.raises(CpumlaError, match="multiple of 32"):
        native.Weight(q[:, :40], "q8", np.zeros((4, 2), np.float16))
    with pytest.raises(CpumlaError, match="float16"):
        native.Weight(q, "q8", s.astype(np.float32))
    with pytest.raises(CpumlaError, match="scale grid"):
        native.Weight(q, "q8", np.zeros((4, 3), np.float16))
    with pytest.raises(CpumlaError, match="needs a scale grid"):
        native.Weight(q, "q8")
    with pytest.raises(CpumlaError, match="1-byte"):
        native.Weight(np.zeros((4, 32), np.uint16), "q4", np.zeros((4, 2), np.float16))
    w4 = native.Weight(np.zeros((4, 32), np.uint8), "q4", s)
    assert (w4.rows, w4.cols, w4.nbytes) == (4, 64, 4 * 32 + 4 * 2 * 2)


def test_owners_name_the_q_files():
    """who_fmt for q8 / q4: the file whose q kernels really run (cpumla_kernel_impl)."""
    best = {"avx512": "avx512vnni", "amx": "avx512vnni", "avx512vnni": "avx512vnni", "avx512f": "avx2",
            "avxvnni": "avxvnni", "avx2": "avx2", "scalar": "scalar"}  # avx512f: no VNNI
    for isa in native.available_isas():
        native.init(isa)
        for fmt in ("q8", "q4"):
            got = {k: native.kernel_impl(f"{k}:{fmt}") for k in native.FORMAT_KERNELS}
            if isa == "neon":
                assert got["gemv"].startswith("neon") and got["gemm"].startswith("neon")
                continue
            tiles = "amx (avx512vnni below 16 tokens)" if isa == "amx" else best[isa]   # amx.c's int8 tiles
            assert got["gemv"] == best[isa] and got["gemm"] == got["head_gemv"] == tiles, (isa, got)
            want_t = {"scalar": "scalar", "avx2": "avx2", "avxvnni": "avx2"}.get(isa, "avx512f")
            assert got["head_gemv_t"] == want_t, (isa, got)
            assert got["dequant"] == "scalar"
    native.init("")


# ---- FP4 (e2m1, 1x32 E8M0 blocks): the integer product of kernels.h -------------------------------
@pytest.mark.parametrize("codes", ["zero", "random", "every"])
@pytest.mark.parametrize("scales", ["normal", "low", "high", "nan"])
def test_fp4_integer_product(isa, codes, scales):
    """gemv and gemm of FP4 weights against reference.fp4_terms (x quantized to int16 per block, codes
    2 * value, E8M0 scale halved): one-block rows give the definition's fp32 term bit for bit (exact
    integer sums), whole rows are within fp32 summation of it, and gemm's tokens are gemv's bits."""
    rng = np.random.default_rng(21)
    for rows, cols in [(37, 32), (19, 288), (9, 2048)]:
        nib = {"zero": rng.choice([0, 8], (rows, cols)), "random": rng.integers(0, 16, (rows, cols)),
               "every": (np.arange(rows)[:, None] + np.arange(cols)[None, :]) % 16}[codes]
        data = (nib[:, 0::2] | (nib[:, 1::2] << 4)).astype(np.uint8)
        lo, hi = {"normal": (118, 134), "low": (0, 3), "high": (252, 255), "nan": (118, 134)}[scales]
        scale = rng.integers(lo, hi, (rows, cols // 32)).astype(np.uint8)
        if scales == "nan":
            scale[::3, 0] = 255
        amp = {"low": 2.0 ** 100, "high": 2.0 ** -100}.get(scales, 1.0)
        w, W = native.Weight(data, "e2m1", scale, (1, 32)), ref.Linear("e2m1", data, scale, (1, 32))
        x = (rng.standard_normal((5, cols)) * amp).astype(np.float32)
        y, ym = native.gemv(w, x[0]), native.gemm(w, x)
        p = W.terms(x)                                              # [5, rows, nb] float32 terms
        want, mag = p.sum(-1), np.abs(p).sum(-1)
        with np.errstate(invalid="ignore"):
            for got, wt, mg in [(y, want[0], mag[0]), (ym, want, mag)]:
                nan = np.isnan(wt)
                assert (np.isnan(got) == nan).all(), f"{isa} {codes} {scales} {cols}: NaN rows"
                assert (np.abs(got - wt)[~nan] <= 1e-5 * mg[~nan] + 1e-30).all(), f"{isa} {codes} {scales} {cols}"
        if cols == 32:
            assert np.array_equal(y.view(np.uint32)[~np.isnan(y)], p[0, :, 0].astype(np.float32).view(np.uint32)[~np.isnan(y)])
        ok = (ym[0].view(np.uint32) == y.view(np.uint32)) | (np.isnan(ym[0]) & np.isnan(y))
        assert ok.all(), f"{isa}: gemm's token 0 differs from gemv"


@pytest.mark.parametrize("scales", ["normal", "low", "nan"])
def test_fp4_fma_gemm_is_the_spec(isa, scales):
    """Levels whose E2M1 gemm has an fp32-FMA form (cpumla_kernel_impl names it, with the fewest tokens
    it takes) give scalar's gemm bit for bit from that many tokens on: exact block sums, blocks added in
    order. Widths over the K chunks' edges, row counts over the panels' edges, strided activations
    with a zero block, one thread (the token count per call stays as given) and all threads."""
    owner = native.kernel_impl("gemm:e2m1")
    m = re.search(r"fp32 FMAs from (\d+) tokens", owner)
    if not m:
        pytest.skip(f"{isa}: the integer tiles serve every E2M1 gemm ({owner})")
    n_min = int(m.group(1))
    rng = np.random.default_rng(31)
    threads = native.get_threads()
    try:
        for rows, cols, n in [(37, 32, n_min), (19, 288, n_min + 5), (70, 544, 64), (33, 1056, 100), (300, 2080, 130)]:
            nib = rng.integers(0, 16, (rows, cols))
            data = (nib[:, 0::2] | (nib[:, 1::2] << 4)).astype(np.uint8)
            lo, hi = (0, 3) if scales == "low" else (118, 134)
            scale = rng.integers(lo, hi, (rows, cols // 32)).astype(np.uint8)
            if scales == "nan":
                scale[::3, 0] = 255
            w = native.Weight(data, "e2m1", scale, (1, 32))
            xbig = np.full((n, cols + 9), np.nan, np.float32)
            xbig[:, :cols] = rng.standard_normal((n, cols)) * np.exp(rng.uniform(-3, 3, (n, 1)))
            xbig[1, :32] = 0.0
            x = xbig[:, :cols]
            native.init("scalar")
            want = native.gemm(w, x).view(np.uint32)
            native.init(isa)
            for t in (1, threads):
                native.set_threads(t)
                got = native.gemm(w, x).view(np.uint32)
                if t == threads and rows < 300:
                    continue                # few rows: the tokens split into calls below n_min
                assert np.array_equal(got, want), (isa, scales, rows, cols, n, t)
    finally:
        native.set_threads(threads)


def test_fp4_other_layouts_are_scalars_fp32_product(isa):
    """FP4 weights the integer product does not take (a partial last block: cols % 32 != 0; 64-wide
    blocks; F32 scales) go to scalar's fp32 product on every level, gemv and gemm alike: its bits."""
    rng = np.random.default_rng(5)
    cases = [((1, 32), 100, "e8m0"), ((1, 64), 256, "e8m0"), ((2, 32), 96, "f32")]
    for block, cols, sk in cases:
        rows = 13
        data = rng.integers(0, 256, (rows, (cols + 1) // 2)).astype(np.uint8)
        grid = (-(-rows // block[0]), -(-cols // block[1]))
        scale = rng.integers(120, 130, grid).astype(np.uint8) if sk == "e8m0" else rng.uniform(0.5, 2, grid).astype(np.float32)
        w = native.Weight(data, "e2m1", scale, block)
        x = rng.standard_normal((3, cols)).astype(np.float32)
        native.init("scalar")
        want_v, want_m = native.gemv(w, x[0]), native.gemm(w, x)
        native.init(isa)
        assert np.array_equal(native.gemv(w, x[0]).view(np.uint32), want_v.view(np.uint32)), (isa, block, cols, sk)
        assert np.array_equal(native.gemm(w, x).view(np.uint32), want_m.view(np.uint32)), (isa, block, cols, sk)
