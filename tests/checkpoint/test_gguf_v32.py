"""GGUF files of arch deepseek32 (DeepSeek-V3.2), written with the gguf package as llama.cpp's converter
writes them (support/gguf_files.py: write_v32), against transformers on the values the file holds: the
config from the metadata (the indexer's sizes, NextN blocks left out), fp32 parity of F32 files (kv_b whole
or split) in prefill and decode past index_topk, F16 / BF16 / Q8_0 files, and bad metadata refused in one
line naming the key. The fixture is test_parity_v32's (index_topk 6 of 12 tokens, top-k choices clear
of ties)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import cpumla
from cpumla.checkpoint.gguf_model import GGUFCheckpoint
from cpumla.errors import CpumlaError

from support import gguf_files, gguf_files_mtp, models
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


# ---- the NextN block: the MTP layer -------------------------------------------------------------------
@pytest.fixture(scope="module")
def v32_mtp(tmp_path_factory):
    """The tiny V3.2 with an MTP layer (support/models.py: Mtp, its reference)."""
    return models.build_v3_mtp(tmp_path_factory.mktemp("v32-mtp"), v32=True)


def test_v32_gguf_nextn_block_is_the_mtp_layer(v32_mtp, tmp_path):
    """The converter's NextN block (blk.3: a decoder layer with its indexer, nextn.eh_proj / enorm / hnorm /
    shared_head_norm) is read as the MTP layer: drafting on by default, its logits in fp32 parity with the
    spec's reference, and the same greedy text with drafts as without."""
    path = tmp_path / "m.gguf"
    gguf_files.write_v32(v32_mtp.main, path, mtp=v32_mtp)
    eng = cpumla.load(str(path))
    assert eng.config.num_hidden_layers == 3 and eng.has_mtp and eng.draft == "mtp"
    check_fp32(*models.mtp_logits(eng, v32_mtp))
    models.same_text_with_drafts(eng)
    # without its eh_proj the block is no MTP layer: the main model runs as before, without drafts
    gguf_files.write_v32(v32_mtp.main, path, mtp=v32_mtp, drop=("blk.3.nextn.eh_proj.weight",))
    eng = cpumla.load(str(path))
    assert not eng.has_mtp and eng.draft == "none"
    eng.reset()
    check_fp32(eng.forward(IDS), models.reference_logits(v32_mtp.main, IDS))


def test_v32_gguf_nextn_block_q8_0(v32_mtp, tmp_path):
    """A Q8_0 file (the NextN block's matrices too, read in place): MTP logits against the reference on the
    values the file holds (support/gguf_files_mtp.py: reference_mtp) within test_gguf.py's Q8_0 bounds at every
    position but one (this random layer has a near-tie in its indexer's top-k or its routing that Q8_0's
    activation rounding flips at one of them), and drafts keeping the greedy text."""
    path = tmp_path / "q8.gguf"
    held = gguf_files.write_v32(v32_mtp.main, path, "Q8_0", mtp=v32_mtp)
    assert {t.name: t.tensor_type for t in gguf.GGUFReader(path).tensors}["blk.3.nextn.eh_proj.weight"] == \
        gguf.GGMLQuantizationType.Q8_0
    eng = cpumla.load(str(path))
    assert eng.has_mtp
    ref = gguf_files_mtp.reference_mtp(models.build_v3_mtp(tmp_path / "ref", v32=True), held)
    got, want = models.mtp_logits(eng, ref)
    cos = (got * want).sum(-1) / np.linalg.norm(got, axis=-1) / np.linalg.norm(want, axis=-1)
    close = (np.abs(got - want).max(-1) < 0.08 * np.abs(want).max()) & (1 - cos < 1e-2)
    assert close.sum() >= len(close) - 1, (np.abs(got - want).max(-1), 1 - cos)
    models.same_text_with_drafts(eng, k=3)


def test_v32_gguf_mtp_file_beside_the_model(v32_mtp, tmp_path):
    """A model's file without the NextN block (the converter's --no-mtp) and its MTP file (--mtp: the block,
    token_embd, output, output_norm) beside it: the MTP layer read from there, in fp32 parity; an MTP file
    whose block is not the model's next is refused in one line naming it."""
    gguf_files.write_v32(v32_mtp.main, tmp_path / "m.gguf")
    gguf_files_mtp.write_v32_mtp(v32_mtp, tmp_path / "mtp-m.gguf")
    eng = cpumla.load(str(tmp_path))
    assert eng.has_mtp and eng.draft == "mtp"
    check_fp32(*models.mtp_logits(eng, v32_mtp))
    models.same_text_with_drafts(eng)
    gguf_files_mtp.write_v32_mtp(v32_mtp, tmp_path / "mtp-m.gguf", metadata={"deepseek32.block_count": 5})
    with pytest.raises(CpumlaError) as e:
        cpumla.load(str(tmp_path / "m.gguf"))
    assert str(tmp_path / "mtp-m.gguf") in str(e.value) and "deepseek32.block_count" in str(e.value), str(e.value)


@pytest.mark.parametrize("name", ["blk.3.attn_q_a.weight", "blk.3.nextn.hnorm.weight", "blk.3.ffn_down_exps.weight"])
def test_v32_gguf_nextn_block_missing_tensor(v32_mtp, tmp_path, name):
    """A NextN block with its eh_proj but not the rest: one line naming the file's tensor."""
    path = tmp_path / "bad.gguf"
    gguf_files.write_v32(v32_mtp.main, path, mtp=v32_mtp, drop=(name,))
    with pytest.raises(CpumlaError) as e:
        cpumla.load(str(path))
    assert name in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert_one_line_error(run_cli("smoke", "--model", str(path)), name, status=2)


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
