"""`cpumla bench --kernels`: GEMV GB/s per weight format next to the read probe, the in-cache rate, code
distributions, GEMM GFLOP/s, the --report document, and bad input."""

from __future__ import annotations

import json

import numpy as np
import pytest

from cpumla import native

from support.cli import assert_one_line_error, run_cli


def test_bench_kernels_json():
    p = run_cli("bench", "--kernels", "-o", "json", "--rows", "64", "--cols", "256", "--seconds", "0.01",
            "--stream-mb", "1", "--formats", "bf16,e4m3,e2m1")
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    assert d["read_probe_gbs"] > 0 and d["isa"] == native.available_isas()[-1]
    gemv = [r for r in d["results"] if r["kernel"] == "gemv"]
    assert [r["format"] for r in gemv] == ["bf16", "e4m3", "e2m1"]
    for r in gemv:
        assert r["gbs"] > 0 and r["probe_gbs"] > 0
        assert r["pct_probe"] == pytest.approx(100 * r["gbs"] / r["probe_gbs"])
        assert 0 < r["cache_gbs"] < float("inf")
    gemm = [r for r in d["results"] if r["kernel"] == "gemm"]
    assert gemm and all(r["gflops"] > 0 and r["fma_peak_gflops"] > 0 and r["cache_gbs"] == 0 for r in gemm)
    for r in gemm:
        if r["peak"]:
            assert r["pct_peak"] == pytest.approx(100 * r["gflops"] / r["peak_gflops"]) and r["peak_gflops"] > 0
        else:
            assert r["pct_peak"] is None and r["no_peak"] == "int8 dot products"
    assert {r["shape"] for r in gemm} >= {"512x2048 @ 2048x2048", "48x2048 @ 1408x2048"}


@pytest.mark.parametrize("isa", ["avx2", "avx512f", "avx512", "amx"])
def test_gemm_shares_only_of_a_peak_that_bounds_it(isa):
    """Each GEMM's share is of the probe of the arithmetic it runs at that level, or none: fp32 FMAs
    (f32 everywhere; bf16 and FP8 where the level has no bf16 dot products; FP4 from the tokens its level
    names), bf16 dot products (avx512), the tiles' bf16 or int8 peak for AMX tiles (amx), none for int8 dot
    products."""
    from support.cli import cli_env

    if isa not in native.available_isas():
        pytest.skip(f"this machine does not run {isa}")
    p = run_cli("bench", "--kernels", "-o", "json", "--rows", "64", "--cols", "256", "--seconds", "0.01",
                "--stream-mb", "1", "--formats", "f32", env={**cli_env(), "CPUMLA_ISA": isa})
    assert p.returncode == 0, p.stderr
    gemm = {(r["format"], r["shape"].split("x")[0]): r for r in json.loads(p.stdout)["results"]
            if r["kernel"] == "gemm"}
    want = {"f32": "fp32 FMA", "bf16": "fp32 FMA", "e4m3": "fp32 FMA", "e2m1": "fp32 FMA", "q8": None, "q4": None}
    if isa == "avx512":
        want.update(bf16="AVX-512 bf16 dot", e4m3="AVX-512 bf16 dot", e2m1=None)
    if isa == "amx":
        want.update(bf16="AMX bf16 tile", e4m3="AMX bf16 tile", e2m1="AMX int8 tile", q8="AMX int8 tile",
                    q4="AMX int8 tile")
    for (fmt, n), r in gemm.items():
        assert r["peak"] == (want[fmt] or ""), (fmt, n, r["isa"], r["peak"])
        if r["peak"]:
            assert r["pct_peak"] == pytest.approx(100 * r["gflops"] / r["peak_gflops"])
            assert r["peak_gflops"] == r["fma_peak_gflops"] if r["peak"] == "fp32 FMA" else r["peak_gflops"] > 0
            if r["peak"].startswith("AMX"):       # a tile multiplies 16 x 16 x 32 (bf16) or x 64 (int8)
                assert r["peak_gflops"] > 4 * r["fma_peak_gflops"]
        else:
            assert r["pct_peak"] is None and r["no_peak"] == "int8 dot products"
    assert len(gemm) == 10


def test_peaks_follow_what_serves_the_product(monkeypatch):
    """bench/peaks.py's rule on the implementations' own words, on a CPU with bf16 dot products (the bf16
    probe on avx512, the fp32 FMA probe on avx512f) and on one without (both on avx2)."""
    from cpumla.bench import peaks

    probes = {"bf16_probe": "avx512", "fma_probe": "avx512f"}
    monkeypatch.setattr(peaks.native, "kernel_impl", lambda k: probes[k])
    dot, fma = "AVX-512 bf16 dot", "fp32 FMA"
    amx = "amx (avx512 below 16 tokens)"
    assert peaks.bound("bf16", amx) == ("AMX bf16 tile", "AMX tiles") and peaks.bound("bf16", amx, 16, 16)[0] == "AMX bf16 tile"
    assert peaks.bound("q4_k", "amx (avx512vnni below 16 tokens)", 16, 512) == ("AMX int8 tile", "AMX tiles")
    assert peaks.bound("bf16", amx, most=15)[0] == dot and peaks.bound("e4m3-e8m0", "avx512")[0] == dot
    assert peaks.bound("bf16", "avx512f")[0] == fma and peaks.bound("f16", "avx512f")[0] == fma
    assert peaks.bound("f32", "amx") == (None, "AMX tiles")
    assert peaks.bound("q8", "amx (avx512vnni below 16 tokens)", 8, 8) == (None, "int8 dot products")
    fp4 = "avx2 (fp32 FMAs from 12 tokens; scalar when cols % 32 != 0 or blocks not 1x32 E8M0)"
    assert peaks.bound("e2m1", fp4, 12, 128)[0] == fma
    assert peaks.bound("e2m1", fp4, 11, 128)[0] is None and peaks.bound("e2m1", fp4)[0] is None
    monkeypatch.setattr(peaks.native, "kernel_formats", lambda: {"gemm": {"bf16": "avx512", "q4": "avx512vnni"}})
    assert peaks.ceiling(["bf16"], {fma: 400.0, dot: 800.0}) == (dot, 800.0, "")
    assert peaks.ceiling(["bf16"], {fma: 400.0, dot: 200.0}) == (fma, 400.0, "")    # the higher bounds the mix
    assert peaks.ceiling(["bf16", "q4"], {fma: 400.0, dot: 800.0}) == (None, 0.0, "int8 dot products")
    assert peaks.ceiling(["bf16"], {fma: 400.0})[0] is None                        # the dot peak not measured
    probes.update(bf16_probe="avx2", fma_probe="avx2")
    assert peaks.dot_name() is None and peaks.bound("bf16", "avx2")[0] == fma
    assert peaks.percent(50.0, 200.0) == 25.0 and peaks.percent(50.0, 0.0) is None


def test_bench_kernels_gguf_formats():
    """GGUF's block types are measured as any format: their own implementation, GB/s of their block bytes
    (rows x blocks a row x bytes a block) and their scales normal; a width that is not whole blocks is
    one line."""
    p = run_cli("bench", "--kernels", "-o", "json", "--rows", "64", "--cols", "256", "--seconds", "0.01",
                "--stream-mb", "1", "--formats", "q4,q4_k,iq2_xxs,mxfp4")
    assert p.returncode == 0, p.stderr
    gemv = [r for r in json.loads(p.stdout)["results"] if r["kernel"] == "gemv"]
    assert [r["format"] for r in gemv] == ["q4", "q4_k", "iq2_xxs", "mxfp4"]
    gemm = {r["format"]: r for r in json.loads(p.stdout)["results"] if r["kernel"] == "gemm"}
    assert {"q4_k", "iq2_xxs", "mxfp4"} <= set(gemm) and gemm["q4_k"]["isa"] == native.kernel_impl("gemm:q4_k")
    for r in gemv[1:]:
        block, per = native.GGUF_FORMATS[r["format"]]
        assert r["isa"] == native.kernel_impl(f"gemv:{r['format']}")
        assert r["gbs"] * r["seconds"] * 1e9 == pytest.approx(64 * 256 // block * per, rel=1e-6)
    import gguf

    from cpumla.bench import kernels as kb
    for fmt in native.GGUF_FORMATS:
        w = kb.gguf_weight(fmt, 8, 256, np.random.default_rng(1))
        v = np.abs(gguf.quants.dequantize(w.data.reshape(-1), gguf.GGMLQuantizationType[fmt.upper()]))
        assert np.isfinite(v).all() and v[v > 0].min() >= np.finfo(np.float32).tiny, fmt
    p = run_cli("bench", "--kernels", "--rows", "64", "--cols", "96", "--formats", "q4_k")
    assert_one_line_error(p, "multiple of 256")


def test_gemv_in_cache_drops_the_call_cost(monkeypatch):
    """The in-cache rate is the extra rows' bytes over their extra time: a GEMV that costs a fixed 5 ms a
    call plus 1 ns a byte reads 1 GB/s by it (the whole call's rate would be far lower); where noise
    makes the larger call no slower, the larger call's own rate stands in."""
    from cpumla.bench import kernels as kb

    clock = [0.0]
    monkeypatch.setattr(kb.time, "perf_counter", lambda: clock[0])

    def fake_gemv(w, x, y):
        clock[0] += 5e-3 + w.nbytes * 1e-9
    monkeypatch.setattr(kb.native, "gemv", fake_gemv)
    rng = np.random.default_rng(0)
    for fmt in ("bf16", "e2m1", "q4"):
        assert kb.gemv_in_cache(fmt, 256, 0.01, rng) == pytest.approx(1.0)

    def flat_gemv(w, x, y):
        clock[0] += 1e-3
    monkeypatch.setattr(kb.native, "gemv", flat_gemv)
    per_row = kb.random_weight("bf16", 1, 256, rng).nbytes
    big = max(64, kb.CACHE_BYTES * kb.native.get_threads() // per_row // 64 * 64)
    assert kb.gemv_in_cache("bf16", 256, 0.01, rng) == pytest.approx(big * per_row / 1e-3 / 1e9)


def test_bench_kernels_codes():
    """--codes runs the FP8 / FP4 GEMVs once per code distribution; other formats once."""
    p = run_cli("bench", "--kernels", "-o", "json", "--rows", "64", "--cols", "256", "--seconds", "0.01",
            "--stream-mb", "1", "--formats", "bf16,e4m3-e8m0,e2m1", "--codes", "random,subnormal,zero")
    assert p.returncode == 0, p.stderr
    gemv = [(r["format"], r["codes"]) for r in json.loads(p.stdout)["results"] if r["kernel"] == "gemv"]
    assert gemv == [("bf16", ""), *[(f, c) for f in ("e4m3-e8m0", "e2m1") for c in ("random", "subnormal", "zero")]]
    p = run_cli("bench", "--kernels", "--rows", "64", "--cols", "256", "--seconds", "0.01", "--stream-mb", "1",
            "--formats", "e4m3", "--codes", "subnormal")
    assert p.returncode == 0, p.stderr
    assert "subnormal" in p.stdout


def test_bench_kernels_report():
    """--report: info, the GEMV operands of every level and every level checked against the spec."""
    p = run_cli("bench", "--kernels", "--report", "-o", "json", "--rows", "64", "--cols", "256", "--seconds", "0.01",
            "--stream-mb", "1", "--formats", "e4m3", "--codes", "zero")
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    assert d["info"]["implementations_available"] == native.available_isas()
    assert {o["isa"] for o in d["operands"]} == set(native.available_isas())
    assert all(o["subnormal_operands"] == 0 and o["wrong_values"] == 0 for o in d["operands"])
    checked = {c["isa"] for c in d["checks"]}
    assert checked == set(native.available_isas()) - {"scalar"}
    assert all(c["ok"] for c in d["checks"]), [c for c in d["checks"] if not c["ok"]][:3]
    kinds = {(c["kernel"], c["format"], c["codes"]) for c in d["checks"]}
    assert ("gemm_many", "e4m3", "subnormal") in kinds and ("head_gemv_t", "bf16", "") in kinds
    p = run_cli("bench", "--kernels", "--report", "--rows", "64", "--cols", "256", "--seconds", "0.01",
            "--stream-mb", "1", "--formats", "f32")
    assert p.returncode == 0, p.stderr
    assert "against the scalar spec" in p.stdout and "WRONG" not in p.stdout


def test_bench_table():
    p = run_cli("bench", "--kernels", "--rows", "64", "--cols", "256", "--seconds", "0.01", "--stream-mb", "1",
            "--formats", "f32")
    assert p.returncode == 0, p.stderr
    assert "read bandwidth probe" in p.stdout and "% of probe" in p.stdout


@pytest.mark.parametrize("args,words", [
    (["bench", "--kernels", "-o", "xml"], ["unknown output format", "xml"]),
    (["bench", "--kernels", "--formats", "int3"], ["unknown weight format", "int3"]),
    (["bench", "--kernels", "--cols", "33"], ["--cols"]),
    (["bench", "--kernels", "--threads", "0"], ["--threads"]),
    (["bench"], ["--kernels"]),
    (["bench", "--kernels", "--codes", "denormal"], ["unknown code distribution", "denormal"]),
    (["bench", "--kernels", "--codes", ","], ["--codes"]),
    (["bench", "deepseek-ai/DeepSeek-V2-Lite", "--dummy-weights", "--report"], ["--report", "--kernels"]),
])
def test_bench_bad_input(args, words):
    assert_one_line_error(run_cli(*args), *words)
