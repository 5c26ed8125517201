"""Loading real checkpoints through cpumla.load and the CLI: bad input is one clear line and a non-zero
exit, and the model directory is left untouched; dummy weights, overrides, the context bound."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

import cpumla
from cpumla import CpumlaError

from support.cli import assert_one_line_error, run_cli, snapshot


def corrupt(v2_lite_dir, tmp_path, how):
    d = tmp_path / "m"
    shutil.copytree(v2_lite_dir, d)
    st = d / "model.safetensors"
    raw = st.read_bytes()
    hlen = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + hlen])
    if how == "truncated":
        st.write_bytes(raw[: len(raw) - 100])
    elif how == "offsets-past-end":
        k = next(k for k in header if k != "__metadata__")
        b, e = header[k]["data_offsets"]
        header[k]["data_offsets"] = [b + 10 ** 9, e + 10 ** 9]
        h = json.dumps(header).encode()
        st.write_bytes(len(h).to_bytes(8, "little") + h + raw[8 + hlen:])
    elif how == "absurd-header":
        st.write_bytes((1 << 60).to_bytes(8, "little") + raw[8:])
    elif how == "missing-tensor":
        from safetensors.torch import load_file, save_file
        sd = load_file(st)
        del sd["model.layers.1.self_attn.kv_b_proj.weight"]
        save_file(sd, st)
    elif how == "wrong-shape":
        from safetensors.torch import load_file, save_file
        sd = load_file(st)
        sd["model.layers.0.self_attn.o_proj.weight"] = sd["model.layers.0.self_attn.o_proj.weight"][:, :-1].contiguous()
        save_file(sd, st)
    elif how == "bad-model-type":
        cfg = json.loads((d / "config.json").read_text())
        cfg["model_type"] = "llama"
        (d / "config.json").write_text(json.dumps(cfg))
    elif how == "v4-config-v3-weights":
        cfg = json.loads((d / "config.json").read_text())
        cfg.update(model_type="deepseek_v4", num_attention_heads=4, o_groups=2, q_lora_rank=24)
        (d / "config.json").write_text(json.dumps(cfg))
    elif how == "invalid-config":
        (d / "config.json").write_text("{ not json")
    elif how == "pickle-only":
        st.unlink()
        torch.save({"w": torch.zeros(1)}, d / "pytorch_model.bin")
    elif how == "missing-shard":
        index = {"metadata": {}, "weight_map": {k: "model-00002-of-00002.safetensors" for k in header
                                                if k != "__metadata__"}}
        (d / "model.safetensors.index.json").write_text(json.dumps(index))
    return d


BAD = [("truncated", "truncated"), ("offsets-past-end", "model.safetensors"), ("absurd-header", "header"),
       ("missing-tensor", "kv_b_proj"), ("wrong-shape", "o_proj"), ("bad-model-type", "llama"),
       ("v4-config-v3-weights", "missing tensor 'head.weight'"), ("invalid-config", "config.json"),
       ("pickle-only", "pickle"), ("missing-shard", "model-00002-of-00002")]


@pytest.mark.parametrize("how,word", BAD, ids=[b[0] for b in BAD])
def test_bad_checkpoint(v2_lite_dir, tmp_path, how, word):
    d = corrupt(v2_lite_dir, tmp_path, how)
    before = snapshot(d)
    with pytest.raises(CpumlaError, match=word):
        cpumla.load(str(d))
    assert_one_line_error(run_cli("smoke", "--model", str(d)), word)
    assert snapshot(d) == before, "the model directory was changed"


def test_loading_is_zero_copy(v2_lite_dir):
    eng = cpumla.load(str(v2_lite_dir))
    w = eng.model.layers[1].kv_b.data
    assert not w.flags.writeable and not w.flags.owndata      # a view into the read-only mapping


def test_load_takes_overrides_as_a_dict_and_the_cli_parses_json():
    """cpumla.load refuses JSON text (one line); the same JSON on the command line still works."""
    text = '{"num_hidden_layers": 2, "n_routed_experts": 4}'
    with pytest.raises(CpumlaError) as err:
        cpumla.load("deepseek-ai/DeepSeek-V2-Lite", dummy_weights=True, hf_overrides=text)
    assert "hf_overrides must be a dict" in str(err.value) and "\n" not in str(err.value)
    p = run_cli("smoke", "--dummy-weights", "--model", "deepseek-ai/DeepSeek-V2-Lite", "--hf-overrides", text,
            "-p", "8", "-n", "16")
    assert p.returncode == 0 and " ok" in p.stdout, p.stderr


def test_dummy_weights_deterministic_and_fp8():
    a = cpumla.load("deepseek-ai/DeepSeek-V3", dummy_weights=True, seed=3, dummy_dtype="fp8",
                    hf_overrides={"num_hidden_layers": 2, "hidden_size": 256, "n_routed_experts": 8,
                                  "first_k_dense_replace": 1, "q_lora_rank": 64, "num_attention_heads": 2})
    assert a.model.layers[0].kv_b.dtype == "e4m3" and a.model.layers[1].experts is not None
    la = a.forward([1, 2, 3])
    b = cpumla.load("deepseek-ai/DeepSeek-V3", dummy_weights=True, seed=3, dummy_dtype="fp8",
                    hf_overrides={"num_hidden_layers": 2, "hidden_size": 256, "n_routed_experts": 8,
                                  "first_k_dense_replace": 1, "q_lora_rank": 64, "num_attention_heads": 2})
    np.testing.assert_array_equal(la, b.forward([1, 2, 3]))
    assert np.isfinite(la).all() and np.abs(la).max() < 1e3


def test_prompt_past_context(v2_lite_dir):
    eng = cpumla.load(str(v2_lite_dir), max_seq_len=8)
    with pytest.raises(CpumlaError, match="context"):
        eng.forward(list(range(9)))
    with pytest.raises(CpumlaError, match="vocabulary"):
        eng.forward([10 ** 6])


def test_one_token_forward_is_the_general_one(v2_lite_dir):
    """forward([an int]) takes a path of its own (no numpy conversion); its logits, position and
    token list are those of the same token as an array, and bad ids leave the state as it was."""
    a, b = cpumla.load(str(v2_lite_dir)), cpumla.load(str(v2_lite_dir))
    a.forward([5, 6, 7])
    b.forward(np.array([5, 6, 7]))
    for tok in (3, 0, a.config.vocab_size - 1):
        np.testing.assert_array_equal(a.forward([tok], last_only=True), b.forward(np.array([tok]), last_only=True))
    assert a.pos == b.pos == 6 and a.tokens == b.tokens == [5, 6, 7, 3, 0, a.config.vocab_size - 1]
    assert all(type(t) is int for t in a.tokens + b.tokens)
    for bad, word in (([-1], "vocabulary"), ([a.config.vocab_size], "vocabulary"), ([True], "bool"),
                      ((2 ** 70,), "vocabulary")):
        with pytest.raises(CpumlaError, match=word):
            a.forward(bad)
    assert a.pos == 6 and len(a.tokens) == 6
    np.testing.assert_array_equal(a.forward((4,)), b.forward([np.int64(4)]))


def test_mtp_layer_is_skipped(v2_lite_dir, tmp_path):
    """V3 ships its multi-token-prediction layer as model.layers.<L>.*: never read."""
    from safetensors.torch import load_file, save_file

    d = tmp_path / "m"
    shutil.copytree(v2_lite_dir, d)
    sd = load_file(d / "model.safetensors")
    L = json.loads((d / "config.json").read_text())["num_hidden_layers"]
    sd[f"model.layers.{L}.eh_proj.weight"] = torch.zeros(3, 5)
    sd[f"model.layers.{L}.self_attn.kv_b_proj.weight"] = torch.zeros(7)      # would not even fit
    save_file(sd, d / "model.safetensors")
    ref = cpumla.load(str(v2_lite_dir)).forward([1, 2, 3])
    np.testing.assert_array_equal(cpumla.load(str(d)).forward([1, 2, 3]), ref)
