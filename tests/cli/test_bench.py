"""`cpumla bench` on a model: llama-bench fields, our machine-relative fields, output formats, bad input."""

from __future__ import annotations

import csv
import io
import json
import re
import subprocess
import sys

import pytest

from cpumla import native

from support.cli import assert_one_line_error, run_cli

TINY = ["deepseek-ai/DeepSeek-V3", "--dummy-weights", "--hf-overrides",
        '{"num_hidden_layers": 2, "hidden_size": 128, "n_routed_experts": 8, "first_k_dense_replace": 1, '
        '"q_lora_rank": 64, "num_attention_heads": 2, "vocab_size": 1024}']


def test_bench_model_json():
    p = run_cli("bench", *TINY, "-p", "16", "-n", "4", "-r", "2", "-d", "0,8", "-t", "1", "-o", "json")
    assert p.returncode == 0, p.stderr
    rows = json.loads(p.stdout)
    assert [r["test"] for r in rows] == ["pp16", "tg4", "pp16 @ d8", "tg4 @ d8"]
    for r in rows:
        for k in ("n_prompt", "n_gen", "n_depth", "n_threads", "avg_ts", "stddev_ts", "samples_ts", "avg_ns"):
            assert k in r
        assert len(r["samples_ts"]) == 2 and r["avg_ts"] > 0 and r["n_threads"] == 1
        assert r["read_probe_gbs"] > 0 and r["fma_peak_gflops"] > 0 and r["peak_rss_mb"] > 0
        assert r["bf16_peak_gflops"] > 0
    pp, tg = rows[0], rows[1]
    assert pp["n_prompt"] == 16 and pp["n_gen"] == 0 and pp["gflops"] > 0 and pp["ttft_ms"] > 0
    if pp["peak"] is not None:          # the share is of the peak named, one of the two measured
        assert pp["pct_peak"] == pytest.approx(100 * pp["gflops"] / pp["peak_gflops"])
        assert pp["peak_gflops"] in (pp["fma_peak_gflops"], pp["bf16_peak_gflops"], pp["amx_bf16_peak_gflops"])
    else:
        assert pp["pct_peak"] is None and pp["no_peak"]
    assert tg["peak"] is None and tg["pct_peak"] is None
    assert tg["n_gen"] == 4 and tg["gbs"] > 0
    assert tg["pct_bandwidth"] == pytest.approx(100 * tg["gbs"] / tg["read_probe_gbs"])
    assert rows[3]["bytes_per_token"] > tg["bytes_per_token"]          # deeper cache, more bytes read


def test_bench_model_csv_jsonl_md():
    p = run_cli("bench", *TINY, "-p", "8", "-n", "2", "-r", "1", "-t", "1", "-o", "csv")
    assert p.returncode == 0, p.stderr
    rows = list(csv.DictReader(io.StringIO(p.stdout)))
    assert [r["test"] for r in rows] == ["pp8", "tg2"]
    p = run_cli("bench", *TINY, "-p", "0", "-n", "2", "-r", "1", "-t", "1", "-o", "jsonl")
    assert [json.loads(line)["test"] for line in p.stdout.splitlines()] == ["tg2"]
    p = run_cli("bench", *TINY, "-p", "8", "-n", "0", "-r", "1", "-t", "1")
    assert "pp8" in p.stdout and "read bandwidth probe" in p.stdout
    # the header names what runs: parameters, the weights' format, the bytes a decode token reads
    assert re.search(r"\d+\.\d\d B parameters, bf16 linear layers, \d+ MB read a decode token", p.stdout), p.stdout


def _at_level(isa: str, *args: str):
    """`cpumla bench` on TINY at one implementation level (the test is skipped where it does not run)."""
    from support.cli import cli_env

    if isa not in native.available_isas():
        pytest.skip(f"this machine does not run {isa}")
    return run_cli("bench", *TINY, "-r", "1", "-t", "1", *args, env={**cli_env(), "CPUMLA_ISA": isa})


@pytest.mark.parametrize("isa,tokens", [("avx2", 32), ("avx512f", 32), ("avx512", 32), ("amx", 32), ("amx", 8)])
def test_prefill_is_a_share_of_a_peak_that_bounds_it(isa, tokens):
    """Prefill's share is only of a peak bounding every product it runs: fp32 FMAs where bf16 weights are
    multiplied by FMAs (avx2, avx512f); the higher of the FMA and bf16 dot peaks where they are dot
    products (avx512, and amx below its tiles' 16 tokens); the tiles' bf16 peak where AMX tiles run (amx from
    16 tokens), the highest of those measured."""
    p = _at_level(isa, "-p", str(tokens), "-n", "0", "-o", "json")
    assert p.returncode == 0, p.stderr
    pp = json.loads(p.stdout)[0]
    fma, dot = pp["fma_peak_gflops"], pp["bf16_peak_gflops"]
    if isa == "amx" and tokens >= 16:
        tile = pp["amx_bf16_peak_gflops"]
        assert pp["peak"] == "AMX bf16 tile" and pp["peak_gflops"] == tile > max(fma, dot)
        assert pp["pct_peak"] == pytest.approx(100 * pp["gflops"] / tile)
        p = _at_level(isa, "-p", str(tokens), "-n", "0")
        line = next(ln for ln in p.stdout.splitlines() if ln.startswith(f"pp{tokens} "))
        assert "% of the AMX bf16 tile peak" in line, line
        assert "AMX bf16 tile" in p.stdout.split("peaks:")[1].splitlines()[0]
        return
    assert (pp["amx_bf16_peak_gflops"] > 0) == (isa == "amx")          # the tile probe runs on the tiles' level only
    if isa in ("avx2", "avx512f"):
        assert pp["peak"] == "fp32 FMA" and pp["peak_gflops"] == fma
    else:
        assert pp["peak_gflops"] == max(fma, dot) > 0
        assert pp["peak"] == ("fp32 FMA" if fma >= dot else "AVX-512 bf16 dot")
    assert pp["pct_peak"] == pytest.approx(100 * pp["gflops"] / pp["peak_gflops"])
    p = _at_level(isa, "-p", str(tokens), "-n", "0")
    assert f"% of the {pp['peak']} peak" in p.stdout, p.stdout


def test_bench_threads_beyond_cores_warns():
    p = run_cli("bench", *TINY, "-p", "0", "-n", "1", "-r", "1", "-t", "64", "-o", "json")
    assert p.returncode == 0 and "64 threads is more than" in p.stderr


@pytest.mark.parametrize("args,words", [
    (["-p", "0", "-n", "0"], ["nothing to measure"]),
    (["-d", "200000"], ["context"]),
    (["-o", "xml"], ["unknown output format"]),
    (["-t", "two"], ["--threads"]),
    (["-r", "0"], ["-r"]),
])
def test_bench_model_bad_input(args, words):
    assert_one_line_error(run_cli("bench", *TINY, *args), *words)


def _script(name):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_decode_phases_script(capsys):
    """benchmarks/decode_phases.py on a shrunk model: samples taken, each filed under a phase, and a
    decode share of the probe that is a positive number; with --quant q4 the weights are quantized (a
    token reads fewer bytes than the same model in bf16)."""
    import json

    from cpumla.cli.smoke import SHRINK

    mod = _script("decode_phases")
    outs = {}
    for quant in ([], ["--quant", "q4"]):
        mod.main(["--seconds", "1", "--tokens", "4", "--layers", "2", "--json", *quant,
                  "--hf-overrides", json.dumps({**SHRINK, "vocab_size": 1000})])
        out = json.loads(capsys.readouterr().out)
        assert out["all"]["samples"] >= 1
        assert out["slow"]["samples"] + out["fast"]["samples"] <= out["all"]["samples"]
        assert 0 < out["all"]["pct_probe"] < float("inf")
        outs[out["quant"]] = out["bytes_per_token"]
    assert 0 < outs["q4"] < 0.5 * outs[None]
    # --prefetch: samples alternate between the targets, each filed apart; the choice is the CPU's after
    mod.main(["--seconds", "0", "--tokens", "2", "--layers", "2", "--json", "--quant", "q8", "--prefetch", "l1,l2",
              "--hf-overrides", json.dumps({**SHRINK, "vocab_size": 1000})])
    out = json.loads(capsys.readouterr().out)
    assert set(out["prefetch"]) == {"l1", "l2"} and "all" not in out
    assert all(r["all"]["samples"] == 1 and r["all"]["pct_probe"] > 0 for r in out["prefetch"].values())
    native.set_gemv_prefetch("auto")


def test_decode_phases_turns(capsys, tmp_path):
    """--turn FILE:I/N: each sample waits for its turn and passes it on (one run: the counter ends at
    the number of samples), and the ready file is gone at the end."""
    import json

    from cpumla.cli.smoke import SHRINK

    counter = tmp_path / "turn"
    counter.write_text("0")
    _script("decode_phases").main(["--seconds", "1", "--tokens", "2", "--layers", "2", "--json",
                                   "--turn", f"{counter}:0/1",
                                   "--hf-overrides", json.dumps({**SHRINK, "vocab_size": 1000})])
    out = json.loads(capsys.readouterr().out)
    assert int(counter.read_text()) == out["all"]["samples"] >= 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["turn"]


def test_decode_jobs_script(capsys):
    """benchmarks/decode_jobs.py: decode and its replay each take samples, every job of the V2 layout is
    timed (the routed experts counted top_k times an expert's bytes), their bytes add up to the
    replay's; a model of another layout is a one-line exit."""
    import json

    from cpumla.cli.smoke import SHRINK

    mod = _script("decode_jobs")
    over = json.dumps({**SHRINK, "vocab_size": 1000})
    mod.main(["--seconds", "0", "--job-seconds", "0", "--tokens", "1", "--layers", "2", "--quant", "q8", "--json",
              "--hf-overrides", over])
    out = json.loads(capsys.readouterr().out)
    got = out["phases"]["all"]
    assert got["decode"]["samples"] == got["replay"]["samples"] == 1
    assert all(r["pct_probe"] > 0 for r in got.values())
    names = [j["job"] for j in out["jobs"]]
    assert names[0] == "layer 0 q" and names[-1] == "output head"
    assert any(n.startswith("layer 1 routed experts") for n in names)
    assert abs(sum(j["mb"] for j in out["jobs"]) * 1e6 - out["replay_bytes"]) < 1.0
    assert 0 < out["replay_bytes"] <= out["bytes_per_token"]
    assert all(j["us"] > 0 and j["pct_probe"] > 0 for j in out["jobs"])
    from cpumla.cli.smoke import default_overrides

    v4 = "deepseek-ai/DeepSeek-V4-Flash"
    with pytest.raises(SystemExit):
        mod.main(["--model", v4, "--seconds", "0", "--layers", "4",
                  "--hf-overrides", json.dumps(default_overrides(v4, {"vocab_size": 1000}))])
    assert "V2 / V3 layer layout" in capsys.readouterr().err


def test_gemv_sizes_script(capsys, tmp_path):
    """benchmarks/gemv_sizes.py on a few weights of each size: every size gets a positive share of the
    probe from the installed library; a tree without a built library is a one-line exit."""
    import json

    mod = _script("gemv_sizes")
    mod.main(["--seconds", "0", "--scale", "0.01", "--format", "q4", "--json"])
    out = json.loads(capsys.readouterr().out)
    got = out["phases"]["all"]["installed"]
    assert got["samples"] >= 1 and set(got["pct_probe"]) == set(mod.SIZES)
    assert all(0 < v < float("inf") for v in got["pct_probe"].values())
    assert all(b > 0 for b in out["set_bytes"].values())
    with pytest.raises(SystemExit, match="no built library"):
        mod.main([str(tmp_path), "--seconds", "0"])
    # --cols: every weight that wide (rows of partial steps), each set about as many bytes as at 2048
    mod.main(["--seconds", "0", "--scale", "0.01", "--format", "q8", "--cols", "1408", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["cols"] == 1408
    for name, (rows, n) in mod.SIZES.items():
        assert out["set_bytes"][name] == max(1, int(n * 2048 / 1408 * 0.01)) * rows * 1408 * 34 // 32
    # --moe: one-token MoE calls, 6 random experts of a table and one expert six times as wide; each
    # pass takes every choice of experts once, and counts the chosen experts' codes and scales
    mod.main(["--moe", "--seconds", "0", "--scale", "0.02", "--format", "q4", "--json"])
    out = json.loads(capsys.readouterr().out)
    got = out["phases"]["all"]["installed"]
    assert set(got["pct_probe"]) == {"routed", "wide"} and all(0 < v < float("inf") for v in got["pct_probe"].values())
    E, K, I, D = mod.MOE
    assert out["set_bytes"] == {"routed": mod.MOE_PICKS * K * 3 * I * D * 18 // 32, "wide": 3 * K * I * D * 18 // 32}
    with pytest.raises(SystemExit):
        mod.main(["--moe", "--kv-b", "--seconds", "0"])
    assert "give one" in capsys.readouterr().err
    assert all(0 < v < float("inf") for v in out["phases"]["all"]["installed"]["pct_probe"].values())
    with pytest.raises(SystemExit):
        mod.main(["--seconds", "0", "--cols", "1000"])
    assert "a multiple of 32" in capsys.readouterr().err
    # one library at two levels or two prefetch targets: each spec is its own copy, timed in turn
    isa = native.available_isas()[-1]
    specs = [f".@{isa}@l1", f".@{isa}@l2+l1", ".@scalar"]
    mod.main([*specs, "--seconds", "0", "--scale", "0.01", "--format", "q8", "--json"])
    out = json.loads(capsys.readouterr().out)
    got = out["phases"]["all"]
    assert set(got) == set(specs) and all(r["samples"] >= 1 for r in got.values())
    # each ran at its own level: the installed library's first copy is not reset by cpumla.native
    assert out["isa"] == {specs[0]: isa, specs[1]: isa, specs[2]: "scalar"}
    # ... also in a fresh process, where cpumla.native starts (at its own level) during the run
    p = subprocess.run([sys.executable, mod.__file__, ".@scalar", "--seconds", "0", "--scale", "0.01",
                        "--format", "q8", "--json"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["isa"] == {".@scalar": "scalar"}
    with pytest.raises(SystemExit, match="unknown implementation 'sse9'"):
        mod.main([".@sse9", "--seconds", "0"])
    # the MLA per-head products of kv_b_proj weights, on the installed library and at the scalar level
    mod.main([".", ".@scalar", "--kv-b", "--seconds", "0", "--scale", "0.01", "--format", "q8", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert set(out["set_bytes"]) == {"absorb", "un-absorb"}
    H, dn, dv, R = mod.KV_B
    assert out["set_bytes"]["absorb"] == H * (dn + dv) * R * 34 // 32 // 2      # q8: half of one weight's bytes
    for r in out["phases"]["all"].values():
        assert r["samples"] >= 1 and all(0 < v < float("inf") for v in r["pct_probe"].values())
    with pytest.raises(SystemExit, match="unknown GEMV prefetch 'l3'"):
        mod.main([f".@{isa}@l3", "--seconds", "0"])


@pytest.mark.parametrize("args,words", [(["--hf-overrides", "[1]"], "must be a JSON object"),
                                        (["--hf-overrides", "{bad"], "not valid JSON"),
                                        (["--tokens", "0"], "at least 1"),
                                        (["--quant", "q3"], "invalid choice: 'q3'"),
                                        (["--model", "nope/nope"], "not a local directory"),
                                        (["--turn", "x"], "--turn must be FILE:I/N"),
                                        (["--turn", "/tmp/t:2/2"], "--turn must be FILE:I/N"),
                                        (["--turn", "/nonexistent/turn:0/2"], "no counter file"),
                                        (["--prefetch", "l1,l3"], "--prefetch takes l1, l2, l2+l1 or auto, not 'l3'")])
def test_decode_phases_bad_input(capsys, args, words):
    """Bad input to the script: usage error (exit 2) with one line naming the problem, no traceback."""
    with pytest.raises(SystemExit) as e:
        _script("decode_phases").main(args)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert words in err[-1] and "Traceback" not in "\n".join(err)


def test_depth_is_the_depth_asked_for():
    """Whatever order the depths come in and whatever each test appended, the cache holds exactly the
    first `depth` tokens of one fixed run before each test (a shallower test must not leave a deeper one
    running at its depth)."""
    import numpy as np

    import cpumla
    from cpumla.bench.model import AtDepth

    eng = cpumla.load("deepseek-ai/DeepSeek-V2-Lite", dummy_weights=True, max_seq_len=64,
                      hf_overrides={"num_hidden_layers": 1, "hidden_size": 64, "n_routed_experts": 4,
                                    "vocab_size": 512})
    at = AtDepth(eng, 24, np.random.default_rng(0))
    for depth in [0, 24, 8, 24, 0, 16, 24]:
        at(depth)
        assert eng.pos == depth and eng.tokens == [int(t) for t in at.tokens[:depth]]
        eng.forward([1, 2, 3])                       # the test itself writes past the depth
