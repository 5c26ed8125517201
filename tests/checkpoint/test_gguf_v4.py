"""GGUF files of arch deepseek4 (DeepSeek-V4), written with the gguf package as llama.cpp's converter writes
them (support/gguf_files_v4.py: write), against transformers on the values the file holds: the config
from the metadata (layer schedule, hash layers, mHC, both RoPEs), fp32 parity of an F32 file in prefill
and decode, F16 / BF16 files, the converter's own types (Q8_0 for the release's FP8 linears, BF16, MXFP4
experts, I32 hash table), and bad metadata refused in one line naming the key."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

import cpumla
from cpumla.checkpoint.gguf_model import GGUFCheckpoint
from cpumla.checkpoint.tensors import GGUF_TYPES
from cpumla.errors import CpumlaError

from support import gguf_files, gguf_files_v4, models
from support.cli import assert_one_line_error, run_cli
from support.models import check_bf16_drift, check_fp32, stepwise

gguf = pytest.importorskip("gguf")

# test_parity_v4's sequence: 11 CSA windows (ratio 4), 5 HCA windows (ratio 8), five sliding windows (8)
IDS = [int(t) for t in np.random.default_rng(1).integers(0, 160, 44)]


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    """(folder saved by transformers, its fp32 logits of IDS): all three layer types, two hash layers,
    index_topk 3 (a real selection)."""
    d = tmp_path_factory.mktemp("v4")
    m = models.build_v4(d)
    return d, models.reference_logits(m, IDS)


@pytest.fixture(scope="module")
def v4_rounded(tmp_path_factory):
    """The fixture for files whose products round (BF16, Q8_0): every layer hash-routed and the indexer
    keeping every entry (index_topk 16 >= 11), so that no rounding flips a routing or a selection (as
    test_parity_v4's release-format test)."""
    d = tmp_path_factory.mktemp("v4r")
    models.build_v4(d, num_hash_layers=5, index_topk=16)
    return d


def test_v4_gguf_f32_parity(v4, tmp_path):
    """F32 file (experts stacked F32, tid2eid I32): fp32 parity, prefill, then decode one token at a time
    across the windows and compressed entries."""
    d, ref = v4
    path = tmp_path / "m.gguf"
    gguf_files_v4.write(d, path)
    eng = cpumla.load(str(path))
    check_fp32(eng.forward(IDS), ref)
    eng.reset()
    check_fp32(stepwise(eng, IDS, 5), ref)


def test_v4_config_from_metadata(v4, tmp_path):
    """The metadata gives the config transformers' saved config.json gives: every field the model derives
    (schedule, hash layers, RoPEs, mHC, sizes) is the same."""
    d, _ = v4
    path = tmp_path / "m.gguf"
    gguf_files_v4.write(d, path)
    with GGUFCheckpoint(path) as g:
        c = g.config
    assert c["model_type"] == "deepseek_v4" and c["compress_rates"]["heavily_compressed_attention"] == 8
    assert (c["num_hash_layers"], c["swiglu_limit"], c["hc_mult"], c["o_groups"], c["head_dim"]) == (2, 10.0, 4, 2, 32)
    got, want = cpumla.load(str(path)).config, cpumla.load(str(d)).config
    assert (got.layer_kinds, got.ratios, got.csa, got.hash) == (want.layer_kinds, want.ratios, want.csa, want.hash)
    assert got.ratios == [0, 4, 8, 4, 8] and got.hash == [True, True, False, False, False]
    np.testing.assert_allclose(got.main_inv_freq, want.main_inv_freq, rtol=1e-6)
    np.testing.assert_allclose(got.compress_inv_freq, want.compress_inv_freq, rtol=1e-6)
    assert got.main_scale == want.main_scale == got.compress_scale == want.compress_scale == 1.0
    for f in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim", "rope_dim",
              "q_lora_rank", "o_groups", "o_lora_rank", "moe_intermediate_size", "n_routed_experts",
              "num_experts_per_tok", "n_shared_experts", "norm_topk_prob", "routed_scaling_factor", "swiglu_limit",
              "hc_mult", "hc_sinkhorn_iters", "sliding_window", "index_n_heads", "index_head_dim", "index_topk",
              "max_position_embeddings"):
        assert getattr(got, f) == getattr(want, f), f
    for f in ("hc_eps", "rms_norm_eps", "rope_theta", "compress_rope_theta"):
        assert getattr(got, f) == pytest.approx(getattr(want, f), rel=1e-6), f


def test_v4_gguf_f16_and_bf16(v4, v4_rounded, tmp_path):
    """F16 matrices multiply fp32 activations: fp32 parity against the f16 values. BF16 ones round the
    activations: no further from the reference than transformers' own bf16 forward (the mHC, position
    biases and sinks stay F32, as the converter keeps the release's f32 tensors)."""
    d, _ = v4
    held = gguf_files_v4.write(d, tmp_path / "f16.gguf", "F16")
    assert held["blk.1.attn_q_a.weight"].dtype == np.float32
    ref = models.reference_logits(gguf_files_v4.reference(d, held, tmp_path / "r16"), IDS)
    check_fp32(cpumla.load(str(tmp_path / "f16.gguf")).forward(IDS), ref)
    held = gguf_files_v4.write(v4_rounded, tmp_path / "bf16.gguf", "BF16")
    rb = gguf_files_v4.reference(v4_rounded, held, tmp_path / "rb")
    ref = models.reference_logits(rb, IDS)
    check_bf16_drift(cpumla.load(str(tmp_path / "bf16.gguf")).forward(IDS), ref,
                     models.reference_logits(rb.to(torch.bfloat16), IDS))


def test_v4_gguf_converter_types(v4_rounded, tmp_path):
    """The types the converter gives the release: Q8_0 for its FP8 linears (read in place), BF16 for its
    bf16 matrices, F32 for its f32 tensors and the vectors, the FP4 experts as MXFP4 (read in place where
    the native library multiplies MXFP4 blocks, else served as the release's e2m1 codes and E8M0 scales:
    the values the gguf package dequantizes, bit for bit), I32 tid2eid. Against transformers on the
    values the file holds, prefill and decode."""
    path = tmp_path / "conv.gguf"
    held = gguf_files_v4.write(v4_rounded, path, "converter")
    Q = gguf.GGMLQuantizationType
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(path).tensors}
    assert (types["blk.1.attn_q_a.weight"], types["blk.1.attn_compressor_kv.weight"], types["blk.1.ffn_up_exps.weight"],
            types["blk.1.hc_attn_fn.weight"], types["blk.0.ffn_gate_tid2eid.weight"]) == (Q.Q8_0, Q.BF16, Q.MXFP4,
                                                                                       Q.F32, Q.I32)
    in_place = "MXFP4" in GGUF_TYPES           # a native library that multiplies MXFP4 blocks as they are
    with GGUFCheckpoint(path) as g:
        name = "layers.3.ffn.experts.5.w2"
        if in_place:
            assert g.info(name + ".weight") == ("MXFP4", (64, 32)) and not g.has(name + ".scale")
        else:
            assert g.info(name + ".weight") == ("I8", (64, 16)) and g.info(name + ".scale") == ("F8_E8M0", (64, 1))
            codes, scale = g.tensor(name + ".weight").view(np.uint8), g.tensor(name + ".scale")
            e2m1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, 0, -.5, -1, -1.5, -2, -3, -4, -6], np.float32)
            nib = np.stack([codes & 15, codes >> 4], -1).reshape(64, 32)
            values = e2m1[nib] * np.exp2(scale.astype(np.float32) - 127).repeat(32, 1)
            assert np.array_equal(values, held["blk.3.ffn_down_exps.weight"][5])
    rm = gguf_files_v4.reference(v4_rounded, held, tmp_path / "ref")
    ref = models.reference_logits(rm, IDS)
    hf_bf16 = models.reference_logits(rm.to(torch.bfloat16), IDS)
    eng = cpumla.load(str(path))
    L = eng.model.layers[1]
    assert (eng.matmul_format, L["experts"]._keep[0][0].dtype, L["attn"][5].dtype) == \
        ("q8_0", "mxfp4" if in_place else "e2m1", "bf16")
    gguf_files.check_q8_drift(eng.forward(IDS), ref, hf_bf16)
    eng.reset()
    gguf_files.check_q8_drift(stepwise(eng, IDS, 5), ref, hf_bf16)


def test_v4_gguf_quantizer_types(v4_rounded, tmp_path):
    """llama-quantize gives a block type to every 2-D tensor whose rows hold whole blocks: the embedding (read
    a row at a time in place), the mHC fn (read in place), and the compressors' position biases (dequantized
    when loaded): here Q8_0 (the tiny widths hold whole blocks of 32), against transformers on the values the
    file holds, prefill and decode."""
    path = tmp_path / "q8.gguf"
    blocked = ("token_embd.weight", "blk.1.attn_compressor_ape.weight", "blk.1.indexer_compressor_ape.weight",
               "blk.2.attn_compressor_ape.weight", "blk.1.hc_attn_fn.weight", "output_hc_fn.weight")
    held = gguf_files_v4.write(v4_rounded, path, "Q8_0", types=dict.fromkeys(blocked, "Q8_0"))
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert {n: types[n] for n in blocked} == dict.fromkeys(blocked, "Q8_0")
    rm = gguf_files_v4.reference(v4_rounded, held, tmp_path / "ref")
    ref = models.reference_logits(rm, IDS)
    hf_bf16 = models.reference_logits(rm.to(torch.bfloat16), IDS)
    eng = cpumla.load(str(path))
    gguf_files.check_q8_drift(eng.forward(IDS), ref, hf_bf16)
    eng.reset()
    gguf_files.check_q8_drift(stepwise(eng, IDS, 5), ref, hf_bf16)


# ---- bad files ------------------------------------------------------------------------------------
@pytest.mark.parametrize("metadata,words", [
    ({"deepseek4.attention.compress_ratios": None}, ["deepseek4.attention.compress_ratios", "missing"]),
    ({"deepseek4.attention.compress_ratios": [0, 4, 8]}, ["deepseek4.attention.compress_ratios", "3 ratios for 5"]),
    ({"deepseek4.attention.compress_ratios": [0, 4, 8, 4, 16]}, ["deepseek4.attention.compress_ratios", "[8, 16]"]),
    ({"deepseek4.attention.compress_ratios": [0, 4, -8, 4, 8]}, ["deepseek4.attention.compress_ratios", "-8"]),
    ({"deepseek4.attention.compress_ratios": 4}, ["deepseek4.attention.compress_ratios", "UINT32", "array"]),
    ({"deepseek4.expert_gating_func": 2}, ["deepseek4.expert_gating_func", "sqrtsoftplus"]),
    ({"deepseek4.expert_gating_func": None}, ["deepseek4.expert_gating_func", "missing"]),
    ({"deepseek4.hash_layer_count": "two"}, ["deepseek4.hash_layer_count", "STRING"]),
    ({"deepseek4.hash_layer_count": None}, ["deepseek4.hash_layer_count", "missing"]),
    ({"deepseek4.hyper_connection.count": None}, ["deepseek4.hyper_connection.count", "missing"]),
    ({"deepseek4.hyper_connection.epsilon": "tiny"}, ["deepseek4.hyper_connection.epsilon", "STRING"]),
    ({"deepseek4.hyper_connection.sinkhorn_iterations": None}, ["deepseek4.hyper_connection.sinkhorn_iterations"]),
    ({"deepseek4.attention.sliding_window": None}, ["deepseek4.attention.sliding_window", "missing"]),
    ({"deepseek4.attention.output_group_count": 2.0}, ["deepseek4.attention.output_group_count", "FLOAT32"]),
    ({"deepseek4.attention.output_lora_rank": None}, ["deepseek4.attention.output_lora_rank", "missing"]),
    ({"deepseek4.attention.compress_rope_freq_base": None}, ["deepseek4.attention.compress_rope_freq_base"]),
    ({"deepseek4.attention.indexer.top_k": None}, ["deepseek4.attention.indexer.top_k", "missing"]),
    ({"deepseek4.attention.indexer.head_count": "8"}, ["deepseek4.attention.indexer.head_count", "STRING"]),
    ({"deepseek4.attention.key_length": None}, ["deepseek4.attention.key_length", "missing"]),
    ({"deepseek4.swiglu_clamp_exp": None}, ["deepseek4.swiglu_clamp_exp", "missing"]),
    ({"deepseek4.swiglu_clamp_exp": [10.0, 10.0, 7.0, 10.0, 10.0]}, ["deepseek4.swiglu_clamp_exp", "alike"]),
    ({"deepseek4.swiglu_clamp_shexp": [7.0] * 5}, ["deepseek4.swiglu_clamp_shexp", "swiglu_clamp_exp 10"]),
    ({"deepseek4.expert_weights_norm": 1}, ["deepseek4.expert_weights_norm", "UINT32", "boolean"]),
    ({"deepseek4.nextn_predict_layers": 5}, ["deepseek4.nextn_predict_layers", "block_count 5"]),
    ({"deepseek4.rope.scaling.type": "longrope"}, ["deepseek4.rope.scaling.type", "longrope"]),
])
def test_v4_bad_metadata(v4, tmp_path, metadata, words):
    """A required key missing or of the wrong type, or a value cpumla cannot run: cpumla.load and
    `cpumla smoke` fail with one line naming the file and the key."""
    path = tmp_path / "bad.gguf"
    gguf_files_v4.write(v4[0], path, metadata=metadata)
    words = [str(path), *words]
    with pytest.raises(CpumlaError) as e:
        cpumla.load(str(path))
    for w in words:
        assert w in str(e.value), str(e.value)
    assert_one_line_error(run_cli("smoke", "--model", str(path)), *words, status=2)


@pytest.mark.parametrize("how,words", [
    ("missing-tid2eid", ["blk.1.ffn_gate_tid2eid.weight", "missing"]),
    ("missing-compressor", ["blk.2.attn_compressor_ape.weight", "missing"]),
    ("missing-sinks", ["blk.0.attn_sinks.weight", "missing"]),
    ("shape-hc", ["blk.3.hc_ffn_fn.weight", "shape"]),
    ("tid2eid-range", ["layers.0.ffn.gate.tid2eid", "outside the 8 routed experts"]),
])
def test_v4_bad_tensors(v4, tmp_path, how, words):
    """A tensor missing or of the wrong shape or values: one line naming it by the file's name."""
    path = tmp_path / "bad.gguf"
    drop, transform = (), {}
    if how.startswith("missing-"):
        drop = (words[0],)
    elif how == "shape-hc":
        transform = {words[0]: lambda a: a[:, :-4]}
    else:
        transform = {"blk.0.ffn_gate_tid2eid.weight": lambda a: a + 7}
    gguf_files_v4.write(v4[0], path, drop=drop, transform=transform)
    with pytest.raises(CpumlaError) as e:
        cpumla.load(str(path))
    for w in words:
        assert w in str(e.value), str(e.value)
    assert_one_line_error(run_cli("smoke", "--model", str(path)), *words, status=2)


# ---- the MTP layer in a file of its own (the converter's --mtp) --------------------------------------
@pytest.fixture(scope="module")
def v4_mtp(tmp_path_factory):
    """(a folder with the model's file m.gguf and its MTP file mtp-m.gguf, both F32; the MtpV4 reference)."""
    d = tmp_path_factory.mktemp("v4-mtp")
    ref = models.build_v4_mtp(d / "hf")
    g = d / "gguf"
    g.mkdir()
    gguf_files_v4.write(d / "hf", g / "m.gguf")
    gguf_files_v4.write_mtp(ref, g / "mtp-m.gguf")
    return g, ref


def test_v4_mtp_file_beside_the_model(v4_mtp, tmp_path):
    """The MTP file beside the model's (`mtp-` + its name) is read as the MTP layer, e_proj and h_proj the
    halves of its eh_proj: drafting on by default, MTP logits in fp32 parity with the spec's reference, the
    same greedy text with drafts as without; the folder names the model (the MTP file is no model of its
    own); without the MTP file the model runs without drafts."""
    g, ref = v4_mtp
    for model in (g / "m.gguf", g):
        eng = cpumla.load(str(model))
        assert eng.has_mtp and eng.draft == "mtp" and eng.config.num_hidden_layers == ref.main.config.num_hidden_layers
        check_fp32(*models.mtp_logits(eng, ref))
    plain = models.same_text_with_drafts(eng)
    alone = tmp_path / "m.gguf"
    shutil.copy(g / "m.gguf", alone)
    eng = cpumla.load(str(alone))
    assert not eng.has_mtp and eng.draft == "none"
    assert list(eng.generate(models.IDS, 12, stop_ids=[])) == plain


def test_v4_mtp_file_in_the_converters_types(v4_mtp, tmp_path):
    """The MTP file in the converter's types (eh_proj Q8_0 read as two halves of whole blocks in place,
    MXFP4 experts, BF16): drafts keep the greedy text; MTP logits close to the F32 file's."""
    g, ref = v4_mtp
    d = tmp_path / "q"
    d.mkdir()
    shutil.copy(g / "m.gguf", d / "m.gguf")
    gguf_files_v4.write_mtp(ref, d / "mtp-m.gguf", "converter")
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(d / "mtp-m.gguf").tensors}
    assert (types["blk.5.nextn.eh_proj.weight"], types["blk.5.ffn_up_exps.weight"]) == ("Q8_0", "MXFP4")
    eng = cpumla.load(str(d / "m.gguf"))
    got, want = models.mtp_logits(eng, ref)
    assert np.median(np.abs(got - want).max(-1)) < 0.08 * np.abs(want).max()
    models.same_text_with_drafts(eng, k=3)


@pytest.mark.parametrize("metadata,drop,words", [
    ({"deepseek4.block_count": 7}, (), ["deepseek4.block_count", "is 7", "6 layers", "m.gguf's 5"]),
    ({"deepseek4.nextn_predict_layers": None}, (), ["deepseek4.nextn_predict_layers", "is 0", "one NextN block"]),
    ({"deepseek4.embedding_length": 32}, (), ["deepseek4.embedding_length", "is 32", "m.gguf's 64"]),
    ({}, ("blk.5.nextn.eh_proj.weight",), ["blk.5.nextn.eh_proj.weight"]),
    ({}, ("blk.5.attn_q_a.weight",), ["blk.5.attn_q_a.weight"]),
    ({}, ("output_hc_fn.weight",), ["output_hc_fn.weight"]),
])
def test_v4_bad_mtp_file(v4_mtp, tmp_path, metadata, drop, words):
    """An MTP file that is not the model's, or lacks a tensor: one line naming it and the key or tensor."""
    g, ref = v4_mtp
    shutil.copy(g / "m.gguf", tmp_path / "m.gguf")
    side = tmp_path / "mtp-m.gguf"
    gguf_files_v4.write_mtp(ref, side, metadata=metadata, drop=drop)
    with pytest.raises(CpumlaError) as e:
        cpumla.load(str(tmp_path / "m.gguf"))
    for w in [str(side), *words]:
        assert w in str(e.value), str(e.value)
    assert_one_line_error(run_cli("smoke", "--model", str(tmp_path / "m.gguf")), str(side), *words, status=2)
