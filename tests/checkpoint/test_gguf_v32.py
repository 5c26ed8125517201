"""GGUF files of arch deepseek32 (DeepSeek-V3.2), written with the gguf package as llama.cpp's converter
writes them (support/gguf_files.py: write_v32), against transformers on the values the file holds: the
config from the metadata (the indexer's sizes, NextN blocks left out), fp32 parity of F32 files (kv_b whole
or split) in prefill and decode past index_topk, F16 / BF16 / Q8_0 files, and bad metadata refused in one
line naming the key. The fixture is test_parity_v32's (index_topk 6 of 12 tokens, top-k choices clear
of ties)."""

from __future__ import annotations

import pytest
import torch

import cpumla
from cpumla.checkpoint.gguf_model import GGUFCheckpoint
from cpumla.errors import CpumlaError

from support import gguf_files, models
from support.cli import assert_one_line_error, run_cli
from support.models import IDS, check_bf16_drift, check_fp32, stepwise

gguf = pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def v32(tmp_path_factory):
    """(transformers model, its fp32 logits of IDS)."""
    m = models.build_v32(tmp_path_factory.mktemp("v32"))
    assert m.config.index_topk < len(IDS)
    return m, models.reference_logits(m, IDS)


@pytest.mark.parametrize("split", [True, False])
def test_v32_gguf_f32_parity(v32, tmp_path, split):
    """F32 file, kv_b split into attn_k_b / attn_v_b or whole: fp32 parity, prefill, then decode one token
    at a time past index_topk (the indexer scores every cached key)."""
    m, ref = v32
    path = tmp_path / "m.gguf"
    gguf_files.write_v32(m, path, split_kv_b=split)
    eng = cpumla.load(str(path))
    check_fp32(eng.forward(IDS), ref)
    eng.reset()
    check_fp32(stepwise(eng, IDS, 3), ref)


def test_v32_config_from_metadata(v32, tmp_path):
    m, ref = v32
    path = tmp_path / "m.gguf"
    gguf_files.write_v32(m, path)
    with GGUFCheckpoint(path) as g:
        c = g.config
    assert (c["model_type"], c["topk_method"], c["scoring_func"]) == ("deepseek_v32", "noaux_tc", "sigmoid")
    assert (c["index_n_heads"], c["index_head_dim"], c["index_topk"]) == (8, 20, 6)
    assert (c["n_group"], c["topk_group"], c["routed_scaling_factor"], c["norm_topk_prob"]) == (4, 2, 2.5, True)
    assert (c["q_lora_rank"], c["kv_lora_rank"], c["qk_nope_head_dim"], c["v_head_dim"]) == (24, 32, 16, 12)
    assert c["num_hidden_layers"] == 3 and c["rope_scaling"]["mscale_all_dim"] == pytest.approx(1.0)
    # the converter counts the appended NextN block in block_count: it is left out (never read)
    gguf_files.write_v32(m, path, metadata={"deepseek32.block_count": 4, "deepseek32.nextn_predict_layers": 1})
    eng = cpumla.load(str(path))
    assert eng.config.num_hidden_layers == 3
    check_fp32(eng.forward(IDS), ref)
    # no expert_gating_func: V3.2 routes by sigmoid all the same
    gguf_files.write_v32(m, path, metadata={"deepseek32.expert_gating_func": None})
    check_fp32(cpumla.load(str(path)).forward(IDS), ref)


def test_v32_gguf_f16_and_bf16(v32, tmp_path):
    """F16: fp32 parity against the f16 values. BF16: no further from the reference than transformers' own
    bf16 forward (the bf16-rounded fixture's top-k choices are clear: test_parity_v32)."""
    m, _ = v32
    held = gguf_files.write_v32(m, tmp_path / "f16.gguf", "F16")
    ref = models.reference_logits(gguf_files.reference_v32(models.build_v32(tmp_path / "r16"), held), IDS)
    check_fp32(cpumla.load(str(tmp_path / "f16.gguf")).forward(IDS), ref)
    held = gguf_files.write_v32(m, tmp_path / "bf16.gguf", "BF16")
    rb = gguf_files.reference_v32(models.build_v32(tmp_path / "rb"), held)
    ref = models.reference_logits(rb, IDS)
    check_bf16_drift(cpumla.load(str(tmp_path / "bf16.gguf")).forward(IDS), ref,
                     models.reference_logits(rb.to(torch.bfloat16), IDS))


def test_v32_gguf_q8_0(v32, tmp_path):
    """Q8_0 (the indexer's wq_b and wk too, read in place; matrices whose rows are not whole blocks F16):
    test_gguf.py's Q8_0 bounds against transformers fp32 on the values the file holds; cached decode equal
    to the full forward."""
    m, _ = v32
    path = tmp_path / "q8.gguf"
    held = gguf_files.write_v32(m, path, "Q8_0")
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(path).tensors}
    assert types["blk.1.indexer.attn_k.weight"] == gguf.GGMLQuantizationType.Q8_0
    ref = models.reference_logits(gguf_files.reference_v32(models.build_v32(tmp_path / "ref"), held), IDS)
    gguf_files.check_q8_file(cpumla.load(str(path)), ref, IDS)


# ---- bad files ------------------------------------------------------------------------------------
@pytest.mark.parametrize("metadata,words", [
    ({"deepseek32.attention.indexer.head_count": None}, ["deepseek32.attention.indexer.head_count", "missing"]),
    ({"deepseek32.attention.indexer.key_length": "20"}, ["deepseek32.attention.indexer.key_length", "STRING"]),
    ({"deepseek32.attention.indexer.top_k": None}, ["deepseek32.attention.indexer.top_k", "missing"]),
    ({"deepseek32.attention.indexer.top_k": 6.0}, ["deepseek32.attention.indexer.top_k", "FLOAT32"]),
    ({"deepseek32.expert_gating_func": 1}, ["deepseek32.expert_gating_func", "sigmoid"]),
    ({"deepseek32.nextn_predict_layers": 3}, ["deepseek32.nextn_predict_layers", "block_count 3"]),
    ({"deepseek32.nextn_predict_layers": True}, ["deepseek32.nextn_predict_layers", "BOOL"]),
    ({"deepseek32.attention.indexer.key_length": 4}, ["index_head_dim", "qk_rope_head_dim"]),
])
def test_v32_bad_metadata(v32, tmp_path, metadata, words):
    """cpumla.load and `cpumla smoke` fail with one line naming the file and the key (or the config field
    it gives)."""
    path = tmp_path / "bad.gguf"
    gguf_files.write_v32(v32[0], path, metadata=metadata)
    words = [str(path), *words]
    with pytest.raises(CpumlaError) as e:
        cpumla.load(str(path))
    for w in words:
        assert w in str(e.value), str(e.value)
    assert_one_line_error(run_cli("smoke", "--model", str(path)), *words, status=2)


@pytest.mark.parametrize("name", ["blk.1.indexer.attn_k.weight", "blk.2.indexer.k_norm.bias", "blk.0.indexer.proj.weight"])
def test_v32_missing_indexer_tensor(v32, tmp_path, name):
    path = tmp_path / "bad.gguf"
    gguf_files.write_v32(v32[0], path, drop=(name,))
    with pytest.raises(CpumlaError) as e:
        cpumla.load(str(path))
    assert name in str(e.value) and "missing" in str(e.value), str(e.value)
    assert_one_line_error(run_cli("smoke", "--model", str(path)), name, "missing", status=2)
