"""Scratch contexts and the library lock from Python: concurrent calls from several threads, a failed
scratch allocation surfacing as CpumlaError (the CPUMLA_SCRATCH_LIMIT test hook), and the per-format
kernel owners (cpumla_kernel_impl("gemv:e2m1")) checked against what each implementation's fill does."""

from __future__ import annotations

import re
import threading

import numpy as np
import pytest

from cpumla import native
from cpumla.errors import CpumlaError

from support import reference as ref

FORMATS = tuple(native.DTYPES)


def _attention_case(rng, n_q, H, dk, dv, T):
    kv = rng.standard_normal((T, dk)).astype(np.float32)
    q = rng.standard_normal((n_q, H, dk)).astype(np.float32)
    kv_len = np.arange(T - n_q + 1, T + 1) if n_q > 1 else None
    rows = [list(range(k)) for k in kv_len] if kv_len is not None else [list(range(T))]
    want, _ = ref.attention(q.astype(np.float64), kv.astype(np.float64), dk, dv, dk ** -0.5, rows, None)
    return (q, kv, dk, dv, dk ** -0.5, kv_len), want, np.abs(kv[:, :dv]).max()


def test_threads_share_the_library(isa):
    """Three Python threads (cffi drops the GIL) hammer gemm, mla_attention and Experts at once with
    different shapes; every result must be the one computed alone, which matches the reference."""
    rng = np.random.default_rng(77)
    jobs = []
    # gemm: bf16 and e4m3 weights of different shapes (their scratch differs in size)
    for fmt, scale_kind, rows, cols, n in (("bf16", None, 96, 700, 9), ("e4m3", "f32", 200, 300, 5)):
        w, W = ref.build(fmt, scale_kind, rows, cols, rng)
        x = rng.standard_normal((n, cols)).astype(np.float32)
        want, mag = W(x)
        jobs.append((lambda w=w, x=x: native.gemm(w, x), want, mag, f"gemm {fmt}"))
    # attention: decode and a causal prefill
    for shape in ((1, 16, 80, 64, 300), (6, 4, 48, 32, 50)):
        args, want, vmag = _attention_case(rng, *shape)
        jobs.append((lambda a=args: native.mla_attention(a[0], a[1], a[2], a[3], a[4], kv_len=a[5]),
                     want, np.full(want.shape, vmag), f"attention {shape}"))
    # experts: prefill (grouped by expert) and decode
    E, D, I, k = 4, 64, 48, 2
    raw = [[ref.build("bf16", None, r, c, rng) for r, c in ((I, D), (I, D), (D, I))] for _ in range(E)]
    table = native.Experts([tuple(wt for wt, _ in ex) for ex in raw])
    for n in (1, 6):
        x = rng.standard_normal((n, D)).astype(np.float32)
        idx = rng.integers(0, E, size=(n, k)).astype(np.int32)
        wts = rng.uniform(0.1, 1.0, size=(n, k)).astype(np.float32)
        want, mag = np.zeros((n, D)), np.zeros((n, D))
        for t in range(n):
            for j in range(k):
                G, U, Dn = (m for _, m in raw[idx[t, j]])
                g, u = G(x[t])[0], U(x[t])[0]
                d, dmag = Dn((g / (1 + np.exp(-g)) * u).astype(np.float32))
                want[t] += wts[t, j] * d
                mag[t] += wts[t, j] * dmag
        jobs.append((lambda x=x, idx=idx, wts=wts: table(x, idx, wts, np.zeros_like(x)), want, mag + 1e-3,
                     f"experts n={n}"))

    alone = []
    for fn, want, mag, what in jobs:
        got = fn()
        ref.assert_close(got, want, mag, rtol=5e-5, what=what)
        alone.append(got)

    errors, lock = [], threading.Lock()

    def worker(order):
        try:
            for it in range(25):
                i = order[it % len(order)]
                got = jobs[i][0]()
                if not np.array_equal(got, alone[i]):
                    raise AssertionError(f"{jobs[i][3]}: result differs under concurrency")
        except Exception as e:  # noqa: BLE001 - reported below
            with lock:
                errors.append(repr(e))

    n_jobs = len(jobs)
    threads = [threading.Thread(target=worker, args=([(s + j) % n_jobs for j in range(n_jobs)],)) for s in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_scratch_failure_is_an_error(isa, monkeypatch):
    """With CPUMLA_SCRATCH_LIMIT below what a kernel needs, the call raises instead of returning
    numbers: gemm of a bf16 weight on ISAs that round activations into scratch, attention everywhere."""
    rng = np.random.default_rng(3)
    w, W = ref.build("bf16", None, 64, 256, rng)
    x = rng.standard_normal((8, 256)).astype(np.float32)
    args, want_attn, _ = _attention_case(rng, 1, 4, 32, 32, 40)
    monkeypatch.setenv("CPUMLA_SCRATCH_LIMIT", "16")
    if isa in ("avx2", "avxvnni", "avx512f", "avx512vnni", "avx512", "amx"):
        with pytest.raises(CpumlaError, match="CPUMLA_SCRATCH_LIMIT"):
            native.gemm(w, x)
        with pytest.raises(CpumlaError, match="CPUMLA_SCRATCH_LIMIT"):
            native.gemv(w, x[0])
    else:                                    # their kernels need no scratch
        want, mag = W(x)
        ref.assert_close(native.gemm(w, x), want, mag, what=f"gemm {isa} under the limit")
    with pytest.raises(CpumlaError, match="attention"):
        native.mla_attention(args[0], args[1], args[2], args[3], args[4])
    table = native.Experts([(w, w, ref.build("bf16", None, 256, 64, rng)[0])])
    with pytest.raises(CpumlaError, match="CPUMLA_SCRATCH_LIMIT"):
        table(x, np.zeros((8, 1), np.int32), np.ones((8, 1), np.float32), np.zeros_like(x))
    monkeypatch.delenv("CPUMLA_SCRATCH_LIMIT")
    want, mag = W(x)
    ref.assert_close(native.gemm(w, x), want, mag, what=f"gemm {isa} after the limit")
    out = native.mla_attention(args[0], args[1], args[2], args[3], args[4])
    ref.assert_close(out, want_attn, np.ones(want_attn.shape), rtol=1e-5, what="attention after the limit")


def test_last_error_is_per_thread():
    """One thread's error does not overwrite another's message."""
    native.ensure_init()
    router = native.Router("softmax", 4, 2)
    bad = native.Router("softmax", 4, 9)
    msgs = {}

    def fail():
        with pytest.raises(CpumlaError):
            bad(np.zeros((1, 4), np.float32))
        msgs["other"] = native.last_error()

    with pytest.raises(CpumlaError, match="out of range"):
        native.Experts([(ref.build("f32", None, 4, 4, np.random.default_rng(0))[0],) * 3])(
            np.zeros((1, 4), np.float32), np.full((1, 1), 5, np.int32), np.ones((1, 1), np.float32),
            np.zeros((1, 4), np.float32))
    t = threading.Thread(target=fail)
    t.start()
    t.join()
    assert "bad router" in msgs["other"]
    assert "out of range" in native.last_error()
    router(np.zeros((1, 4), np.float32))


# what each implementation's fill serves, per weight format (kernels.h who_fmt)
UPPER = {("gemv", "bf16"), ("gemv", "e4m3"), ("gemm", "bf16"), ("gemm", "e4m3"), ("head_gemv", "bf16"),
         ("head_gemv", "e4m3"), ("head_gemv_t", "bf16")}      # what avx512 (vdpbf16ps, VBMI) takes over


FP4_HANDBACK = " (scalar when cols % 32 != 0 or blocks not 1x32 E8M0)"
FP4_FMA_GEMM = {"avx2": 12, "avx512f": 40}     # the levels whose E2M1 gemm has an fp32-FMA form, from n tokens


def expected_owner(isa, kernel, fmt):
    if fmt in native.GGUF_FORMATS:           # gguf_q.c: scalar, avx2, avx512vnni and neon fill gemm_gq
        if kernel not in ("gemv", "gemm", "head_gemv"):
            return "scalar"
        if isa == "amx" and kernel in ("gemm", "head_gemv"):
            return None                      # amx_gq.c's tiles, from a number of tokens per type (below)
        return {"avx2": "avx2", "avxvnni": "avx2", "avx512f": "avx2", "avx512vnni": "avx512vnni",
                "avx512": "avx512vnni", "amx": "avx512vnni", "neon": "neon"}.get(isa, "scalar")
    if fmt == "e2m1" and kernel in ("gemv", "gemm", "head_gemv"):     # the integer product (quant.c)
        if isa == "scalar":
            return "scalar"
        if isa == "neon":
            return None                      # "neon" or "neon (sdot)", with the hand-back
        if kernel in ("gemm", "head_gemv") and isa == "amx":              # amx.c's int8 tiles
            return "amx (avx512vnni below 16 tokens; " + FP4_HANDBACK[2:]
        if kernel in ("gemm", "head_gemv") and isa in FP4_FMA_GEMM:     # avx2_gemm.c / avx512_gemm.c: gemm_fp4
            return f"{isa} (fp32 FMAs from {FP4_FMA_GEMM[isa]} tokens; " + FP4_HANDBACK[2:]
        return ("avx512vnni" if isa in ("avx512", "amx") else isa) + FP4_HANDBACK     # avx512f: avx512f_fp4.c
    if fmt in native.QUANT_FORMATS:          # the q entries (test_quant.py checks them by name)
        if kernel == "dequant" or isa == "scalar":
            return "scalar"
        if isa == "neon":
            return None if kernel != "head_gemv_t" else "scalar"
        if kernel == "head_gemv_t":          # avx2_q.c's; avx512f_q.c's from avx512f up
            return "avx2" if isa in ("avx2", "avxvnni") else "avx512f"
        if isa in ("avx2", "avx512f"):
            return "avx2"                    # avx512f has no q products of its own: avx2's serve
        if isa == "avxvnni":
            return "avxvnni"                 # avx2_q.c with vpdpbusd on ymm
        if isa == "amx" and kernel in ("gemm", "head_gemv"):
            return "amx (avx512vnni below 16 tokens)"     # amx.c's int8 tiles, over avx512vnni_q.c
        return "avx512vnni"                  # avx512vnni_q.c, vpdpbusd on zmm: avx512vnni, avx512 and amx
    if isa in ("scalar", "neon", "avx512f"):
        return isa
    if isa == "avx512vnni":
        return "avx512f"                     # avx512vnni has the integer products alone
    if isa in ("avx2", "avxvnni"):
        return "avx2"                        # avxvnni has the integer products alone
    if isa in ("avx512", "amx"):
        if isa == "amx" and kernel in ("gemm", "head_gemv") and fmt in ("bf16", "e4m3"):
            return None                      # amx.c's tiles, named with what serves the rest
        return "avx512" if (kernel, fmt) in UPPER else "avx512f"
    raise AssertionError(isa)


def expected_entry(isa, kernel):
    """who[] of a kernel's table entry: the top level that fills it"""
    if isa == "amx":
        return "amx" if kernel in ("gemm", "head_gemv") else expected_entry("avx512", kernel)   # head_gemv: gemm's entry
    if isa == "avx512":
        return "avx512f" if kernel == "dequant" else "avx512"
    if isa in ("avxvnni", "avx512vnni"):     # they fill the integer products alone
        return {"avxvnni": "avx2", "avx512vnni": "avx512f"}[isa]
    return isa


def test_kernel_owners_per_format(isa):
    table = native.kernel_formats()
    assert set(table) == set(native.FORMAT_KERNELS)
    for kernel, row in table.items():
        assert set(row) == set(FORMATS)
        assert native.kernel_impl(kernel).split()[0] == expected_entry(isa, kernel), kernel
        for fmt, owner in row.items():
            want = expected_owner(isa, kernel, fmt)
            if want is not None:
                assert owner == want, (kernel, fmt, owner)
    if isa == "neon":
        assert table["gemv"]["e2m1"].startswith("neon") and table["gemv"]["e2m1"].endswith(FP4_HANDBACK)
    if isa == "amx":
        for fmt in native.GGUF_FORMATS:
            for kernel in ("gemm", "head_gemv"):
                m = re.fullmatch(r"amx \(avx512vnni below (\d+) tokens\)", table[kernel][fmt])
                assert m and 16 <= int(m[1]) <= 256, (kernel, fmt, table[kernel][fmt])
        assert table["gemm"]["bf16"] == "amx (avx512 below 16 tokens)"
        assert table["gemm"]["e4m3"] == "amx (avx512 below 16 tokens or for blocks not of 32k rows and columns)"
    with pytest.raises(CpumlaError):
        native.kernel_impl("gemv:int3")
    with pytest.raises(CpumlaError):
        native.kernel_impl("rmsnorm:bf16")


def _e2m1(rows, cols, block_cols, rng):
    data = rng.integers(0, 256, size=(rows, cols // 2), dtype=np.uint8)
    scale = rng.integers(120, 130, size=(rows, -(-cols // block_cols)), dtype=np.uint8)
    return native.Weight(data, "e2m1", scale, (1, block_cols))


def test_avx2_hands_odd_fp4_blocks_to_scalar():
    """avx2's gemv:e2m1 says scalar serves layouts other than 1x32 E8M0 blocks (here 48-wide blocks): those
    results are scalar's fp32 product bit for bit, while 32-wide blocks run avx2's own integer product
    (scalar's up to the association of the block sums)."""
    if "avx2" not in native.available_isas():
        pytest.skip("avx2: this CPU/OS cannot run it")
    rng = np.random.default_rng(8)
    x = rng.standard_normal(480).astype(np.float32)
    odd, fast = _e2m1(37, 480, 48, rng), _e2m1(37, 480, 32, rng)
    try:
        native.init("scalar")
        want_odd, want_fast = native.gemv(odd, x), native.gemv(fast, x)
        native.init("avx2")
        assert "scalar" in native.kernel_impl("gemv:e2m1")
        np.testing.assert_array_equal(native.gemv(odd, x), want_odd)
        got = native.gemv(fast, x)
        np.testing.assert_allclose(got, want_fast, rtol=1e-5, atol=1e-4)
        assert not np.array_equal(got, want_fast)        # summed in another order: avx2's own loop
    finally:
        native.init("")
