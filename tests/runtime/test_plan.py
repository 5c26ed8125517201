"""What a model takes before loading (runtime/plan.py, `cpumla info MODEL`): its sizes agree with what
loading and `cpumla quantize` really make, and the memory refusal names the --quant that would fit."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

import cpumla
from cpumla import CpumlaError
from cpumla.checkpoint import safetensors as st
from cpumla.models import family
from cpumla.runtime import resolve
from cpumla.runtime.plan import plan

from support.cli import assert_one_line_error, run_cli

V3 = "deepseek-ai/DeepSeek-V3"
TINY = {"num_hidden_layers": 3, "first_k_dense_replace": 1, "hidden_size": 256, "intermediate_size": 512,
        "moe_intermediate_size": 128, "n_routed_experts": 8, "num_attention_heads": 4, "q_lora_rank": 192,
        "vocab_size": 1000}
GIB = 1 << 30


def tensor_bytes(directory) -> int:
    """Bytes of every tensor in a checkpoint directory's safetensors files (headers left out)."""
    ck = st.Checkpoint(directory)
    try:
        return sum(ck.tensor_nbytes(n) for n in ck.keys())
    finally:
        ck.close()


@pytest.mark.parametrize("model,overrides", [(V3, TINY), ("deepseek-ai/DeepSeek-V3.2", TINY),
                                             ("deepseek-ai/DeepSeek-V2-Lite", {"num_hidden_layers": 3})])
def test_counts_match_the_tensor_table(model, overrides):
    """Parameters and bytes from the grouped walk equal a walk over every tensor the model reads."""
    cfg, _ = resolve.load_config(model, overrides)
    fam = family(cfg.model_type)
    table = fam.tensors(cfg)
    p = plan(model, overrides)
    mtp = f"model.layers.{cfg.num_hidden_layers}."          # V3's and V3.2's MTP layer: not among the parameters
    assert cfg.model_type == "deepseek_v2" or any(name.startswith(mtp) for name in table)
    assert p.params == sum(math.prod(s) for name, (s, _) in table.items() if not name.startswith(mtp))
    bf16 = sum(4 * math.prod(s) if k == "bias" else 2 * math.prod(s) for s, k in table.values())
    assert p.weights.get("bf16", p.weights["stored"]) == bf16
    assert p.weights["q4"] < p.weights["q8"] < bf16


@pytest.mark.parametrize("fmt", ["q8", "q4"])
def test_quantized_bytes_are_what_quantize_writes(tmp_path, fmt):
    """`cpumla quantize` of a checkpoint: the tensors written take the bytes the plan said, and the plan
    of the written checkpoint says the same as stored."""
    p = run_cli("quantize", V3, str(tmp_path / "dummy-q"), "--quant", fmt, "--dummy-weights", "--hf-overrides",
            json.dumps(TINY))
    assert p.returncode == 0, p.stderr
    want = plan(V3, TINY).weights[fmt]
    got = tensor_bytes(tmp_path / "dummy-q")
    assert got == want, (got, want)
    assert plan(str(tmp_path / "dummy-q")).weights["stored"] == want


def test_quantize_on_load_refused_when_it_cannot_fit(monkeypatch):
    need_q8 = plan("deepseek-ai/DeepSeek-V2-Lite").need("q8")
    need_q4 = plan("deepseek-ai/DeepSeek-V2-Lite").need("q4")
    monkeypatch.setenv("CPUMLA_MEMORY_AVAILABLE", str((need_q8 + need_q4) // 2))
    with pytest.raises(CpumlaError, match="--quant q4 would fit") as e:
        cpumla.load("deepseek-ai/DeepSeek-V2-Lite", dummy_weights=True, quant="q8")
    assert "\n" not in str(e.value) and "q8 weights" in str(e.value)
    with pytest.raises(CpumlaError, match="--quant q8 would fit"):     # bf16 dummy weights: q8 is the hint
        monkeypatch.setenv("CPUMLA_MEMORY_AVAILABLE", str(need_q8 + 1))
        cpumla.load("deepseek-ai/DeepSeek-V2-Lite", dummy_weights=True)
    monkeypatch.setenv("CPUMLA_MEMORY_AVAILABLE", str(need_q4 // 2))
    with pytest.raises(CpumlaError, match="smaller --ctx"):
        cpumla.load("deepseek-ai/DeepSeek-V2-Lite", dummy_weights=True, quant="q4")


@pytest.mark.parametrize("quant", [None, "q4"])
def test_dummy_weights_from_a_config_only_folder_too_big_is_a_memory_refusal(tmp_path, quant):
    """The memory refusal (and its --quant hint) plans dummy weights from the config alone: it never opens
    the folder's checkpoint, which dummy weights do not have."""
    (tmp_path / "config.json").write_text(json.dumps(resolve.resolve_model("deepseek-ai/DeepSeek-V2-Lite").config))
    with pytest.raises(CpumlaError) as e:
        cpumla.load(str(tmp_path), dummy_weights=True, quant=quant, hf_overrides={"num_hidden_layers": 2_000_000})
    assert "of memory" in str(e.value) and "safetensors" not in str(e.value), str(e.value)


def test_info_model(monkeypatch):
    monkeypatch.setenv("CPUMLA_MEMORY_AVAILABLE", str(20 * GIB))
    p = run_cli("info", "deepseek-ai/DeepSeek-V2-Lite", "--json")
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    assert 15e9 < d["params"] < 16.5e9                       # V2-Lite: 15.7 B parameters
    assert d["fits"] == {"stored": False, "q8": True, "q4": True}
    # the latent cache: (kv_lora_rank + rope dims) fp32 per layer and token
    assert d["cache_per_1k_tokens"] == 4 * (512 + 64) * 27 * 1000
    p = run_cli("info", "deepseek-ai/DeepSeek-V2-Lite")
    assert p.returncode == 0 and "--quant q8 would fit" in p.stdout, p.stdout
    p = run_cli("info", "deepseek-ai/DeepSeek-V4-Flash", "--ctx", "100000")
    assert p.returncode == 0 and "not supported for deepseek_v4" in p.stdout
    assert_one_line_error(run_cli("info", "no/such-model"), "not a known preset")
    assert_one_line_error(run_cli("info", "deepseek-ai/DeepSeek-V2-Lite", "--ctx", "0"), "--ctx")


def test_v4_cache_grows_with_compressed_entries():
    """V4's cache per 1k tokens is the compressed one, far below a latent cache of the same width."""
    p = plan("deepseek-ai/DeepSeek-V4-Flash")
    cfg, _ = resolve.load_config("deepseek-ai/DeepSeek-V4-Flash")
    assert p.cache_per_1k < 4 * cfg.head_dim * cfg.num_hidden_layers * 1000 / 4
    assert np.isfinite(p.cache_per_1k) and p.cache > p.cache_per_1k


def test_v4_base_ships_fp8_experts():
    """The -Base presets differ from V4-Flash / -Pro in the routed experts' format only (the MTP layer's
    included): FP8 with a 128x128 E8M0 grid (1 byte a weight + a scale per block) instead of FP4 with one
    per 32 (0.5 + 1/32)."""
    for repo in ("deepseek-ai/DeepSeek-V4-Flash", "deepseek-ai/DeepSeek-V4-Pro"):
        fp4, fp8 = plan(repo), plan(repo + "-Base")
        cfg, _ = resolve.load_config(repo)
        D, I = cfg.hidden_size, cfg.moe_intermediate_size
        n = 3 * cfg.n_routed_experts * (cfg.num_hidden_layers + 1)       # the MTP layer's experts too
        per = (D * I + -(-D // 128) * -(-I // 128)) - (D * I // 2 + D * I // 32)
        assert fp8.params == fp4.params and fp8.weights["stored"] - fp4.weights["stored"] == n * per


def test_peak_rss_of_a_quantized_model():
    """Quantized on load, a model's peak RSS stays within its q4 weights + cache + 300 MB: the dummy
    bf16 weights it came from are not kept resident (in a fresh process, measured by the kernel). The
    peak is VmHWM, the high-water mark of the process's own memory: getrusage's ru_maxrss starts from
    the parent's peak (Linux records the mm a vfork child shares with its parent at exec), so under a
    test runner that has grown past the bound it would fail whatever cpumla does."""
    import subprocess
    import sys

    code = """
import numpy as np, cpumla
from cpumla.runtime.plan import plan
ov = {"num_hidden_layers": 4}
p = plan("deepseek-ai/DeepSeek-V2-Lite", ov, 1024)
e = cpumla.load("deepseek-ai/DeepSeek-V2-Lite", dummy_weights=True, hf_overrides=ov, quant="q4", max_seq_len=1024)
e.forward(np.arange(600) % 1000, last_only=True)
e.forward([5], last_only=True)
hwm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:")) * 1024
print(hwm - p.weights["q4"] - p.cache)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    excess = int(r.stdout.split()[-1])
    assert excess <= 300 << 20, f"peak RSS is {excess >> 20} MiB over the q4 weights and the cache"


V4_TINY = {"num_hidden_layers": 4, "vocab_size": 1000, "n_routed_experts": 16, "compress_ratios": [0, 4, 128, 4, 0]}


@pytest.mark.parametrize("model,overrides,dtype,quant,fmt", [
    (V3, TINY, "bf16", None, "bf16"), (V3, TINY, "fp8", None, "stored"), (V3, TINY, "bf16", "q4", "q4"),
    (V3, TINY, "bf16", "q8", "q8"), ("deepseek-ai/DeepSeek-V3.2", TINY, "bf16", None, "bf16"),
    ("deepseek-ai/DeepSeek-V4-Flash", V4_TINY, "bf16", None, "stored")])
def test_token_bytes_are_what_a_decode_token_reads(model, overrides, dtype, quant, fmt):
    """The plan's weight bytes a decode token reads (every weight once, top_k of the routed experts, one
    embedding row) are the model's own count of them, once built, within its norms and cache rows."""
    eng = cpumla.load(model, dummy_weights=True, hf_overrides=overrides, dummy_dtype=dtype, quant=quant,
                      max_seq_len=64)
    try:
        built = eng.model.decode_bytes(0)
    finally:
        eng.close()
    assert plan(model, overrides).token_bytes[fmt] == pytest.approx(built, rel=2e-3)


def _info(*args, memory: int | None = None):
    from support.cli import cli_env

    env = cli_env(CPUMLA_MEMORY_AVAILABLE=str(memory) if memory else None)
    p = run_cli("info", *args, env=env, timeout=120)
    assert p.returncode == 0, p.stderr
    return p.stdout


def test_info_says_the_decode_speed_here():
    """tok/s = the read probe's GB/s over the bytes a token reads, in the line and the table alike, and in
    --json for every format."""
    import re

    over = ["--hf-overrides", json.dumps(TINY)]
    d = json.loads(_info(V3, *over, "--json"))
    here = d["decode_here"]
    assert 1.0 < here["read_probe_gbs"] < 1e4
    assert d["token_bytes"] == plan(V3, TINY).token_bytes
    for f, b in d["token_bytes"].items():
        assert here["tok_s"][f] == pytest.approx(here["read_probe_gbs"] * 1e9 / b, rel=1e-9)
    out = _info(V3, *over)
    m = re.search(r"^decode here: about ([\d.]+) tok/s as released \(([\d.]+) MB a token at ([\d.]+) GB/s "
                  r"measured\)$", out, re.M)
    assert m, out
    tok_s, mb, gbs = map(float, m.groups())
    assert mb == round(plan(V3, TINY).token_bytes["stored"] / 1e6, 2)
    assert tok_s == pytest.approx(gbs * 1e3 / mb, rel=0.01)
    row = next(line for line in out.splitlines() if line.startswith("as released "))
    assert row.rstrip().endswith(f"{tok_s:.1f} tok/s")


def test_info_says_what_would_fit():
    """When no format fits: the routed experts from disk (the rest fits), the GGUF size that would, and
    the largest presets that fit; with too little memory for any of them, that."""
    avail = 100 * GIB
    d = json.loads(_info("deepseek-ai/DeepSeek-V2", "--json", memory=avail))
    assert not any(d["fits"].values())
    room = avail - d["cache"] - d["scratch"]
    out = _info("deepseek-ai/DeepSeek-V2", memory=avail)
    lines = out[out.index("as released it does not fit, nor with --quant; what would:"):].splitlines()[1:]
    assert len(lines) == 3 and all(line.startswith("  - ") for line in lines), out
    assert "routed experts read from disk" in lines[0] and "--memory SIZE" in lines[0]
    # Q3_K: 110 bytes a block of 256, 3.44 bits a weight, the largest GGUF type below the room's bits
    assert f"at most {room / GIB:.1f} GiB: {8 * room / d['params']:.2f} bits a weight" in lines[1]
    assert "(Q3_K takes 3.44;" in lines[1] and 3.44 < 8 * room / d["params"] < 4.25
    assert lines[2] == ("  - a smaller model: moonshotai/Moonlight-16B-A3B, moonshotai/Moonlight-16B-A3B-Instruct "
                        "(16.0 B parameters, as released); deepseek-ai/DeepSeek-V2-Lite, "
                        "deepseek-ai/DeepSeek-V2-Lite-Chat (15.7 B parameters, as released)")
    out = _info(V3, memory=4 * GIB)
    assert out.rstrip().endswith("what would:\n  - no model cpumla knows of fits in 4.0 GiB"), out
