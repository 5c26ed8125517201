"""The CLI as a user runs it: a subprocess, exit codes, one-line errors, JSON that parses."""

from __future__ import annotations

import json
import os
import subprocess
import sys

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


@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512", "amx", "neon"])
def test_info_honours_cpumla_isa(isa):
    p = run("info", "--json", env={"CPUMLA_ISA": isa})
    if isa in native.available_isas():
        assert p.returncode == 0, p.stderr
        d = json.loads(p.stdout)
        assert d["implementation"] == isa
        assert d["kernels"]["gemv"] == isa
        if isa == "scalar":
            assert all(v in ("scalar", "portable") for v in d["kernels"].values())
    else:
        assert_one_line_error(p, isa)


@pytest.mark.parametrize("isa,kernel,fmt", [("scalar", "gemv", "e2m1"), ("avx2", "gemv", "e4m3"),
                                            ("avx2", "head_gemv_t", "bf16"), ("avx512", "gemm", "bf16"),
                                            ("avx512", "gemv", "e2m1")])
def test_info_reports_owner_per_format(isa, kernel, fmt):
    """`cpumla info --json` has a kernel x format table naming what really serves each format."""
    if isa not in native.available_isas():
        pytest.skip(f"{isa}: this CPU/OS cannot run it")
    p = run("info", "--json", env={"CPUMLA_ISA": isa})
    assert p.returncode == 0, p.stderr
    formats = json.loads(p.stdout)["kernel_formats"]
    assert set(formats) == {"gemv", "gemm", "head_gemv", "head_gemv_t", "dequant"}
    assert all(set(row) == set(native.DTYPES) for row in formats.values())
    assert formats[kernel][fmt] == isa
    if isa == "avx2":
        assert formats["gemv"]["e2m1"].startswith("avx2 (scalar when")


def test_info_table_shows_formats():
    p = run("info")
    assert p.returncode == 0, p.stderr
    assert "kernels by weight format" in p.stdout and "e4m3" in p.stdout


def test_unknown_isa_is_one_line_error():
    assert_one_line_error(run("info", env={"CPUMLA_ISA": "sse9"}), "unknown implementation", "sse9")


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
        assert r["gbs"] > 0 and r["pct_probe"] == pytest.approx(100 * r["gbs"] / d["read_probe_gbs"])
    assert any(r["kernel"] == "gemm" and r["gflops"] > 0 for r in d["results"])


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
])
def test_bench_bad_input(args, words):
    assert_one_line_error(run(*args), *words)
