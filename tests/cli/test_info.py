"""`cpumla info`: the implementation chosen and why (CPUMLA_ISA, the features a level lacks), the kernel
owners by weight format, the GEMV prefetch target (CPUMLA_PREFETCH), threads."""

from __future__ import annotations

import json

import pytest

from cpumla import native

from support.cli import assert_one_line_error, cli_env, run_cli


def test_info_json_picks_the_best_implementation():
    p = run_cli("info", "--json")
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    assert d["implementation"] == native.available_isas()[-1]
    assert set(d["kernels"]) == set(native.KERNELS)
    assert d["threads"] >= 1 and d["cpu"]
    assert d["implementations_available"] == native.available_isas()


@pytest.mark.parametrize("isa", native.ISAS)
def test_info_honours_cpumla_isa(isa):
    p = run_cli("info", "--json", env=cli_env(CPUMLA_ISA=isa))
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
    p = run_cli("info", "--json", env=cli_env(CPUMLA_ISA=isa))
    assert p.returncode == 0, p.stderr
    formats = json.loads(p.stdout)["kernel_formats"]
    assert set(formats) == {"gemv", "gemm", "head_gemv", "head_gemv_t", "dequant"}
    assert all(set(row) == set(native.DTYPES) for row in formats.values())
    assert formats[kernel][fmt] == owner
    if isa == "avx2":
        assert formats["gemv"]["e2m1"].startswith("avx2 (scalar when")


def test_info_table_shows_formats():
    p = run_cli("info")
    assert p.returncode == 0, p.stderr
    assert "kernels by weight format" in p.stdout and "e4m3" in p.stdout


def test_info_gemv_prefetch():
    """`cpumla info` names where the AVX-512 GEMVs prefetch; CPUMLA_PREFETCH sets it; a bad value is one
    line naming the variable, exit 2."""
    d = json.loads(run_cli("info", "--json").stdout)
    assert d["gemv_prefetch"].split()[0] in ("l1", "l2", "l2+l1")
    for where in ("l1", "l2", "l2+l1"):
        p = run_cli("info", "--json", env=cli_env(CPUMLA_PREFETCH=where))
        assert p.returncode == 0, p.stderr
        assert json.loads(p.stdout)["gemv_prefetch"] == f"{where} (set)"
    p = run_cli("info", env=cli_env(CPUMLA_PREFETCH="l3"))
    assert_one_line_error(p, "unknown GEMV prefetch 'l3'", "CPUMLA_PREFETCH", status=2)


def test_unknown_isa_is_one_line_error():
    p = run_cli("info", env=cli_env(CPUMLA_ISA="sse9"))
    assert_one_line_error(p, "unknown implementation", "sse9", "this machine runs: " + " ".join(native.available_isas()))
    assert p.returncode == 2


@pytest.mark.parametrize("isa", native.ISAS)
def test_unrunnable_isa_names_what_runs(isa):
    """A level this CPU or OS cannot run (or not built here): one line naming the levels that run here
    and, for a level built here, the missing features; exit 2."""
    if isa in native.available_isas():
        pytest.skip(f"{isa} runs here")
    p = run_cli("info", env=cli_env(CPUMLA_ISA=isa))
    assert_one_line_error(p, isa, "this machine runs: " + " ".join(native.available_isas()))
    if isa in native.built_isas():
        assert "missing: " in p.stderr
    assert p.returncode == 2


def test_info_threads():
    p = run_cli("info", "--json", "--threads", "1")
    assert json.loads(p.stdout)["threads"] == 1


def test_info_names_what_an_implementation_lacks():
    d = json.loads(run_cli("info", "--json").stdout)
    missing = d["implementations_missing"]
    for isa in native.built_isas():
        assert (isa in missing) == (isa not in native.available_isas())
    if "amx" in missing:
        assert "AMX_TILE" in missing["amx"] or "OS support for AMX" in missing["amx"]
        p = run_cli("info", env=cli_env(CPUMLA_ISA="amx"))
        assert_one_line_error(p, "missing: ", missing["amx"], status=2)
