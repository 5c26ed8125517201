"""q8 / q4 end to end: quantize on load (cpumla.load(..., quant=), --quant), `cpumla quantize` writing a
checkpoint that loads zero-copy and gives the same logits, and its bad input: one clear line, a
non-zero exit, the source untouched and no checkpoint-looking output left behind."""

from __future__ import annotations

import json
import resource
import signal
import subprocess
import sys

import numpy as np
import pytest

import cpumla
from cpumla import CpumlaError, native
from cpumla.checkpoint import safetensors as st
from cpumla.cli import quantize as Q

from support import models
from support.cli import assert_one_line_error, run_cli, snapshot

V3 = "deepseek-ai/DeepSeek-V3"
TINY = {"num_hidden_layers": 2, "first_k_dense_replace": 1, "hidden_size": 256, "intermediate_size": 512,
        "moe_intermediate_size": 128, "n_routed_experts": 8, "num_attention_heads": 4, "q_lora_rank": 192,
        "vocab_size": 1000}
IDS = [5, 17, 900, 3, 44, 12, 7, 301]


def load(quant=None, **kw):
    return cpumla.load(V3, dummy_weights=True, hf_overrides=TINY, seed=1, max_seq_len=64, quant=quant, **kw)


@pytest.fixture(scope="module")
def bf16_logits():
    eng = load()
    out = eng.forward(IDS)
    eng.close()
    return out


@pytest.mark.parametrize("fmt", ["q8", "q4"])
def test_quantize_on_load(fmt, bf16_logits):
    seen = []
    eng = load(fmt, progress=lambda done, total: seen.append((done, total)))
    m = eng.model
    L = m.layers[1]
    assert eng.matmul_format == fmt and eng.rounded_activations
    assert L.q_a.dtype == L.o_proj.dtype == fmt
    assert L.kv_b.dtype == "q8"                    # the latent up-projection is q8 under q4 too
    assert all(w.dtype == fmt for trio in L.experts._keep for w in trio)
    assert L.gate.dtype == "bf16"                  # the router stays as stored
    assert m.lm_head.dtype == "q8"                 # the output head is q8 under q4 too
    assert m.embed.dtype == np.uint16              # the embedding table stays bf16
    dones = [d for d, _ in seen]
    assert seen and dones == sorted(dones) and seen[-1][0] == seen[-1][1]
    logits = eng.forward(IDS)
    assert np.isfinite(logits).all()
    # close to the bf16 model: most top-1 agree, relative error bounded
    rel = np.abs(logits - bf16_logits).max() / np.abs(bf16_logits).max()
    assert rel < (0.05 if fmt == "q8" else 0.3), rel
    # decode through the cache matches a full forward
    eng.reset()
    eng.forward(IDS[:5])
    steps = np.stack([eng.forward([t])[-1] for t in IDS[5:]])
    err = np.abs(steps - logits[5:]).max() / np.abs(logits).max()
    assert err < 2 ** -6, err
    eng.close()


def test_smoke_with_quant():
    from cpumla.cli import smoke

    r = smoke.run(V3, dummy_weights=True, hf_overrides=TINY, quant="q4", prompt_tokens=12, decode_tokens=6)
    assert r.passed, r.status


def test_quantize_command_round_trip(tmp_path, bf16_logits):
    """`cpumla quantize` then load: the same logits as quantizing on load, read in place."""
    out = tmp_path / "q4"
    p = run_cli("quantize", V3, str(out), "--quant", "q4", "--dummy-weights", "--seed", "1",
            "--hf-overrides", json.dumps(TINY))
    assert p.returncode == 0, p.stderr
    assert "wrote" in p.stdout
    cfg = json.loads((out / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert qc["quant_method"] == "cpumla" and qc["format"] == "q4" and qc["format_version"] == 1
    assert not [f for f in tmp_path.iterdir() if f.name.startswith(".")]        # no partial directory left
    eng = cpumla.load(str(out), max_seq_len=64)
    L = eng.model.layers[1]
    assert L.kv_a.dtype == "q4" and eng.model.lm_head.dtype == "q8" and L.gate.dtype == "bf16"
    ck = eng._src
    assert isinstance(ck, st.Checkpoint)
    # zero-copy: the weight's data lies in the file's mapping
    shard = ck.files[ck.file_of("model.layers.1.self_attn.kv_a_proj_with_mqa.weight").name]
    base = np.frombuffer(shard._mm, np.uint8)
    a = L.kv_a.data.ctypes.data
    assert base.ctypes.data <= a < base.ctypes.data + base.size
    got = eng.forward(IDS)
    on_load = load("q4")
    np.testing.assert_array_equal(got, on_load.forward(IDS))
    # a quantized checkpoint is refused as a source, and with --quant
    p = run_cli("quantize", str(out), str(tmp_path / "again"), "--quant", "q8")
    assert_one_line_error(p, "already quantized")
    with pytest.raises(CpumlaError, match="already quantized"):
        cpumla.load(str(out), quant="q8")
    p = run_cli("smoke", "--model", str(out), "--quant", "q8")
    assert_one_line_error(p, "already quantized")


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    """A tiny V2-Lite saved by transformers, with a tokenizer-like file to copy."""
    d = tmp_path_factory.mktemp("v2lite")
    models.build("v2-lite", d)
    (d / "tokenizer_config.json").write_text("{}\n")
    return d


@pytest.fixture(scope="module")
def real_q8(real, tmp_path_factory):
    out = tmp_path_factory.mktemp("q") / "q8"
    before = snapshot(real)
    p = run_cli("quantize", str(real), str(out), "--quant", "q8")
    assert p.returncode == 0, p.stderr
    assert snapshot(real) == before                  # the source is only read
    assert (out / "tokenizer_config.json").is_file()
    return out


def test_real_checkpoint_quantized(real, real_q8):
    ref = cpumla.load(str(real), max_seq_len=32).forward([1, 5, 9, 30])
    eng = cpumla.load(str(real_q8), max_seq_len=32)
    assert eng.model.layers[0].kv_a.dtype == "q8"
    assert eng.model.layers[0].o_proj.dtype == "f32"             # 48 columns: not a multiple of 32, kept
    got = eng.forward([1, 5, 9, 30])
    assert np.abs(got - ref).max() < 0.05 * np.abs(ref).max()


def _rewrite(src_dir, dst_dir, edit):
    """A copy of a one-shard-per-file checkpoint with edit(name, array) -> array or None (dropped)."""
    import shutil

    shutil.copytree(src_dir, dst_dir)
    index = json.loads((dst_dir / st.INDEX_NAME).read_text())
    for shard in sorted(set(index["weight_map"].values())):
        f = st.SafetensorsFile(src_dir / shard)
        entries = []
        for name in f.keys():
            a = edit(name, f.tensor(name).copy())
            if a is None:
                del index["weight_map"][name]
                continue
            entries.append((name, f.info(name)[0], a.shape, lambda a=a: a))
        st.write_file(dst_dir / shard, entries)
    (dst_dir / st.INDEX_NAME).write_text(json.dumps(index))


KV_A = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"


@pytest.mark.parametrize("how,words", [
    ("scale-blocks", ["kv_a_proj_with_mqa.weight_qscale", "one scale per 32"]),
    ("no-scale", ["no scale tensor", "kv_a_proj_with_mqa.weight_qscale"]),
    ("version", ["format_version", "2"]),
])
def test_bad_quantized_checkpoint(real_q8, tmp_path, how, words):
    d = tmp_path / how
    if how == "scale-blocks":
        _rewrite(real_q8, d, lambda n, a: a[:, :-1] if n == KV_A + "_qscale" else a)
    elif how == "no-scale":
        _rewrite(real_q8, d, lambda n, a: None if n == KV_A + "_qscale" else a)
    else:
        _rewrite(real_q8, d, lambda n, a: a)
        cfg = json.loads((d / "config.json").read_text())
        cfg["quantization_config"]["format_version"] = 2
        (d / "config.json").write_text(json.dumps(cfg))
    before = snapshot(d)
    with pytest.raises(CpumlaError) as e:
        cpumla.load(str(d))
    for w in words:
        assert w in str(e.value), str(e.value)
    p = run_cli("smoke", "--model", str(d))
    assert_one_line_error(p, *words)
    assert snapshot(d) == before


def test_quantize_bad_input(real, real_q8, tmp_path):
    p = run_cli("quantize", str(real), str(tmp_path / "x"), "--quant", "q5")
    assert_one_line_error(p, "--quant", "q5")
    p = run_cli("quantize", str(real), str(tmp_path / "x"))
    assert_one_line_error(p, "--quant")
    p = run_cli("chat", str(real), "--quant", "int4", "-p", "hi")
    assert_one_line_error(p, "--quant", "int4")
    p = run_cli("bench", "--kernels", "--quant", "q4")
    assert_one_line_error(p, "--quant", "--formats")
    # an existing output directory: refused, untouched; with --force too when cpumla did not write it
    existing = tmp_path / "exists"
    existing.mkdir()
    (existing / "keep.txt").write_text("mine")
    p = run_cli("quantize", str(real), str(existing), "--quant", "q4")
    assert_one_line_error(p, "exists", "--force")
    p = run_cli("quantize", str(real), str(existing), "--quant", "q4", "--force")
    assert_one_line_error(p, "did not write")
    assert [f.name for f in existing.iterdir()] == ["keep.txt"] and (existing / "keep.txt").read_text() == "mine"
    # into the source itself
    p = run_cli("quantize", str(real), str(real / "sub"), "--quant", "q4")
    assert_one_line_error(p, "overlaps the checkpoint")
    with pytest.raises(CpumlaError, match="not supported for deepseek_v4"):
        cpumla.load("deepseek-ai/DeepSeek-V4-Flash", dummy_weights=True, quant="q4")


def _limit_file_size():
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)          # a write past the limit fails with EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, 20_000))


def test_quantize_full_disk(real, tmp_path):
    """A write that fails part way (files limited to 20 kB, as a full disk would stop them): one line,
    nothing at OUTDIR, no partial directory, the source untouched."""
    before = snapshot(real)
    out = tmp_path / "full"
    e = {k: v for k, v in __import__("os").environ.items() if k != "CPUMLA_ISA"}
    p = subprocess.run([sys.executable, "-m", "cpumla", "quantize", str(real), str(out), "--quant", "q4"],
                       capture_output=True, text=True, env=e, timeout=300, preexec_fn=_limit_file_size)
    assert_one_line_error(p, "writing failed", str(out))
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []
    assert snapshot(real) == before


def test_quantize_api_reports_progress(tmp_path):
    seen = []
    s = Q.quantize_checkpoint(V3, tmp_path / "o", "q8", dummy_weights=True, hf_overrides=TINY,
                              progress=lambda d, t: seen.append((d, t)), shard_bytes=1 << 20)
    assert s["quantized"]["q8"] > 10 and seen[-1][0] == seen[-1][1] > 0
    shards = [f for f in (tmp_path / "o").iterdir() if f.suffix == ".safetensors"]
    assert len(shards) > 1                                          # 1 MiB shards
    assert s["bytes"] < 0.6 * s["source_bytes"]
    native.init("")


SMALL = json.dumps({"num_hidden_layers": 2, "n_routed_experts": 4})


def test_cli_quant_flags():
    """--quant on chat, bench and serve's loader: it runs, and the model is in that format."""
    p = run_cli("chat", "deepseek-ai/DeepSeek-V2-Lite-Chat", "--dummy-weights", "--hf-overrides", SMALL, "--quant", "q4",
            "-p", "hi", "--max-tokens", "2", "--seed", "1")
    assert p.returncode == 0, p.stderr
    p = run_cli("bench", "deepseek-ai/DeepSeek-V2-Lite", "--dummy-weights", "--hf-overrides", SMALL, "--quant", "q8",
            "-p", "8", "-n", "4", "-r", "1", "-t", "1", "-o", "json")
    assert p.returncode == 0, p.stderr
    assert {r["test"] for r in json.loads(p.stdout)} == {"pp8", "tg4"}
    from cpumla.server.model import load_served

    served, _ = load_served("deepseek-ai/DeepSeek-V2-Lite-Chat", dummy_weights=True, hf_overrides=json.loads(SMALL),
                            quant="q8")
    assert served.engine.matmul_format == "q8"
    served.engine.close()


def test_quantized_preset_chats_as_it_is(tmp_path):
    """A preset quantized on dummy weights gets its family's bundled DeepSeek tokenizer copied in when its
    vocabulary covers it, so `cpumla chat OUT` runs without --tokenizer: V3's (129280 ids) for a V3 preset,
    V2's (102400 ids, its chat_template: prompt ids BOS User : ␣hi \n \n Assistant :) for a V2 preset; a V3
    preset whose vocabulary is too small for it is told it has none."""
    small = {k: v for k, v in TINY.items() if k != "vocab_size"}
    out = tmp_path / "v3"
    p = run_cli("quantize", V3, str(out), "--quant", "q4", "--dummy-weights", "--hf-overrides", json.dumps(small))
    assert p.returncode == 0, p.stderr
    assert (out / "tokenizer.json").is_file() and "tokenizer copied in" in p.stderr
    p = run_cli("chat", str(out), "-p", "hi", "-n", "2", "--temperature", "0")
    assert p.returncode == 0, p.stderr
    out = tmp_path / "v2"
    p = run_cli("quantize", "deepseek-ai/DeepSeek-V2-Lite", str(out), "--quant", "q4", "--dummy-weights",
                "--hf-overrides", json.dumps({"num_hidden_layers": 2, "n_routed_experts": 4, "hidden_size": 256,
                                              "intermediate_size": 512, "moe_intermediate_size": 128}))
    assert p.returncode == 0, p.stderr
    assert (out / "tokenizer.json").is_file() and "tokenizer copied in, DeepSeek's V2 tokenizer" in p.stderr
    cfg = json.loads((out / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert cfg["bos_token"] == "<｜begin▁of▁sentence｜>" and "Assistant:" in cfg["chat_template"]
    p = run_cli("chat", str(out), "-p", "hi", "-n", "2", "--temperature", "0")
    assert p.returncode == 0, p.stderr
    assert "prompt 8 tok" in p.stderr and "vocab_size" not in p.stderr    # [100000, 5726, 25, 2868, 185, 185, 77398, 25]
    out = tmp_path / "v3-small-vocab"
    p = run_cli("quantize", V3, str(out), "--quant", "q4", "--dummy-weights", "--hf-overrides", json.dumps(TINY))
    assert p.returncode == 0, p.stderr
    assert not (out / "tokenizer.json").exists() and "has no tokenizer" in p.stderr
