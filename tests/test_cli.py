"""The CLI as a user runs it: a subprocess, exit codes, one-line errors, JSON that parses."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from cpumla import native


def run(*args, env=None, timeout=120):
    e = dict(os.environ)
    e.pop("CPUMLA_ISA", None)
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "cpumla", *args], capture_output=True, text=True,
                          env=e, timeout=timeout)


def assert_one_line_error(p, *words):
    assert p.returncode != 0
    assert "Traceback" not in p.stderr + p.stdout
    lines = [line for line in p.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), p.stderr
    for w in words:
        assert w in lines[0], lines[0]


def test_no_args_prints_help():
    p = run()
    assert "Usage" in p.stdout + p.stderr and "info" in p.stdout + p.stderr
    assert "Traceback" not in p.stderr


def test_info_json_picks_the_best_implementation():
    p = run("info", "--json")
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    assert d["implementation"] == native.available_isas()[-1]
    assert set(d["kernels"]) == set(native.KERNELS)
    assert d["threads"] >= 1 and d["cpu"]
    assert d["implementations_available"] == native.available_isas()


@pytest.mark.parametrize("isa", native.ISAS)
def test_info_honours_cpumla_isa(isa):
    p = run("info", "--json", env={"CPUMLA_ISA": isa})
    if isa in native.available_isas():
        assert p.returncode == 0, p.stderr
        d = json.loads(p.stdout)
        assert d["implementation"] == isa
        assert d["kernels"]["gemv"] == {"amx": "avx512", "avxvnni": "avx2", "avx512vnni": "avx512f"}.get(isa, isa)
        if isa == "scalar":
            assert all(v in ("scalar", "portable") for v in d["kernels"].values())
    else:
        assert_one_line_error(p, isa)


@pytest.mark.parametrize("isa,kernel,fmt,owner", [
    ("scalar", "gemv", "e2m1", "scalar"), ("avx2", "gemv", "e4m3", "avx2"), ("avx2", "head_gemv_t", "bf16", "avx2"),
    ("avx512f", "gemv", "bf16", "avx512f"), ("avx512f", "gemm", "e4m3", "avx512f"),
    ("avx512", "gemm", "bf16", "avx512"), ("avx512", "gemv", "e4m3", "avx512"),
    ("avx512", "gemv", "e2m1", "avx512vnni (scalar when cols % 32 != 0 or blocks not 1x32 E8M0)"),
    ("avx512vnni", "gemm", "q8", "avx512vnni"), ("avx512vnni", "gemv", "e4m3", "avx512f"),
    ("avx512", "dequant", "bf16", "avx512f"), ("avxvnni", "gemm", "q4", "avxvnni"), ("avxvnni", "gemv", "bf16", "avx2"),
    ("avxvnni", "gemm", "e2m1", "avxvnni (scalar when cols % 32 != 0 or blocks not 1x32 E8M0)")])
def test_info_reports_owner_per_format(isa, kernel, fmt, owner):
    """`cpumla info --json` has a kernel x format table naming what really serves each format."""
    if isa not in native.available_isas():
        pytest.skip(f"{isa}: this CPU/OS cannot run it")
    p = run("info", "--json", env={"CPUMLA_ISA": isa})
    assert p.returncode == 0, p.stderr
    formats = json.loads(p.stdout)["kernel_formats"]
    assert set(formats) == {"gemv", "gemm", "head_gemv", "head_gemv_t", "dequant"}
    assert all(set(row) == set(native.DTYPES) for row in formats.values())
    assert formats[kernel][fmt] == owner
    if isa == "avx2":
        assert formats["gemv"]["e2m1"].startswith("avx2 (scalar when")


def test_info_table_shows_formats():
    p = run("info")
    assert p.returncode == 0, p.stderr
    assert "kernels by weight format" in p.stdout and "e4m3" in p.stdout


def test_info_gemv_prefetch():
    """`cpumla info` names where the AVX-512 GEMVs prefetch; CPUMLA_PREFETCH sets it; a bad value is one
    line naming the variable, exit 2."""
    d = json.loads(run("info", "--json").stdout)
    assert d["gemv_prefetch"].split()[0] in ("l1", "l2", "l2+l1")
    for where in ("l1", "l2", "l2+l1"):
        p = run("info", "--json", env={"CPUMLA_PREFETCH": where})
        assert p.returncode == 0, p.stderr
        assert json.loads(p.stdout)["gemv_prefetch"] == f"{where} (set)"
    p = run("info", env={"CPUMLA_PREFETCH": "l3"})
    assert_one_line_error(p, "unknown GEMV prefetch 'l3'", "CPUMLA_PREFETCH")
    assert p.returncode == 2


def test_unknown_isa_is_one_line_error():
    p = run("info", env={"CPUMLA_ISA": "sse9"})
    assert_one_line_error(p, "unknown implementation", "sse9", "this machine runs: " + " ".join(native.available_isas()))
    assert p.returncode == 2


@pytest.mark.parametrize("isa", native.ISAS)
def test_unrunnable_isa_names_what_runs(isa):
    """A level this CPU or OS cannot run (or not built here): one line naming the levels that run here
    and, for a level built here, the missing features; exit 2."""
    if isa in native.available_isas():
        pytest.skip(f"{isa} runs here")
    p = run("info", env={"CPUMLA_ISA": isa})
    assert_one_line_error(p, isa, "this machine runs: " + " ".join(native.available_isas()))
    if isa in native.built_isas():
        assert "missing: " in p.stderr
    assert p.returncode == 2


def test_info_threads():
    p = run("info", "--json", "--threads", "1")
    assert json.loads(p.stdout)["threads"] == 1


def test_bench_kernels_json():
    p = run("bench", "--kernels", "-o", "json", "--rows", "64", "--cols", "256", "--seconds", "0.01",
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
        assert r["pct_fma_peak"] == pytest.approx(100 * r["gflops"] / r["fma_peak_gflops"])
    assert {r["shape"] for r in gemm} >= {"512x2048 @ 2048x2048", "48x2048 @ 1408x2048"}


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
    p = run("bench", "--kernels", "-o", "json", "--rows", "64", "--cols", "256", "--seconds", "0.01",
            "--stream-mb", "1", "--formats", "bf16,e4m3-e8m0,e2m1", "--codes", "random,subnormal,zero")
    assert p.returncode == 0, p.stderr
    gemv = [(r["format"], r["codes"]) for r in json.loads(p.stdout)["results"] if r["kernel"] == "gemv"]
    assert gemv == [("bf16", ""), *[(f, c) for f in ("e4m3-e8m0", "e2m1") for c in ("random", "subnormal", "zero")]]
    p = run("bench", "--kernels", "--rows", "64", "--cols", "256", "--seconds", "0.01", "--stream-mb", "1",
            "--formats", "e4m3", "--codes", "subnormal")
    assert p.returncode == 0, p.stderr
    assert "subnormal" in p.stdout


def test_bench_kernels_report():
    """--report: info, the GEMV operands of every level and every level checked against the spec."""
    p = run("bench", "--kernels", "--report", "-o", "json", "--rows", "64", "--cols", "256", "--seconds", "0.01",
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
    p = run("bench", "--kernels", "--report", "--rows", "64", "--cols", "256", "--seconds", "0.01",
            "--stream-mb", "1", "--formats", "f32")
    assert p.returncode == 0, p.stderr
    assert "against the scalar spec" in p.stdout and "WRONG" not in p.stdout


def test_bench_table():
    p = run("bench", "--kernels", "--rows", "64", "--cols", "256", "--seconds", "0.01", "--stream-mb", "1",
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
    assert_one_line_error(run(*args), *words)
