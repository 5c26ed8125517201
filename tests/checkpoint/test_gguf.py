"""GGUF models (llama.cpp's format) loaded in place: files written with the gguf package's GGUFWriter as
llama.cpp's converter writes them (support/gguf_files.py), against transformers fp32 on the values the
file holds; the config from the metadata; files, folders and split sets; bad files refused in one line."""

from __future__ import annotations

import numpy as np
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
def tiny(tmp_path_factory):
    """variant -> (transformers model, its fp32 logits on IDS)."""
    out = {}
    for v in models.VARIANTS:
        m = models.build(v, tmp_path_factory.mktemp(v))
        out[v] = (m, models.reference_logits(m, IDS))
    return out


@pytest.mark.parametrize("variant,split", [("v2-lite", True), ("v2", False), ("v3", True), ("moonlight", False)])
def test_gguf_f32_parity(tiny, tmp_path, variant, split):
    """F32 file, kv_b whole (older files) or split into attn_k_b / attn_v_b: fp32 parity, prefill and
    decode one token at a time."""
    m, ref = tiny[variant]
    path = tmp_path / "m.gguf"
    gguf_files.write(m, path, "F32", split_kv_b=split)
    eng = cpumla.load(str(path))
    check_fp32(eng.forward(IDS), ref)
    eng.reset()
    check_fp32(stepwise(eng, IDS, 5), ref)


def test_gguf_config_from_metadata(tiny, tmp_path):
    m, _ = tiny["v2"]
    path = tmp_path / "v2.gguf"
    gguf_files.write(m, path)
    with GGUFCheckpoint(path) as g:
        c = g.config
    assert (c["model_type"], c["topk_method"], c["scoring_func"]) == ("deepseek_v2", "group_limited_greedy", "softmax")
    assert (c["n_group"], c["topk_group"], c["routed_scaling_factor"], c["norm_topk_prob"]) == (4, 2, 16.0, False)
    assert (c["q_lora_rank"], c["kv_lora_rank"], c["qk_nope_head_dim"], c["v_head_dim"]) == (24, 32, 16, 12)
    assert c["rope_scaling"]["factor"] == 8.0 and abs(c["rope_scaling"]["mscale_all_dim"] - 0.707) < 1e-6
    m, _ = tiny["v2-lite"]
    gguf_files.write(m, path)
    with GGUFCheckpoint(path) as g:
        assert g.config["q_lora_rank"] is None and g.config["topk_method"] == "greedy"


def test_gguf_v3_nextn_block(tmp_path):
    """deepseek2 with a NextN block (V3 with its MTP layer; llama.cpp's converter leaves it out, other
    writers keep it): read as the MTP layer, its logits in fp32 parity with the spec's reference, and the
    same greedy text with drafts as without."""
    ref = models.build_v3_mtp(tmp_path / "hf")
    path = tmp_path / "m.gguf"
    gguf_files.write(ref.main, path, mtp=ref)
    eng = cpumla.load(str(path))
    assert eng.config.num_hidden_layers == ref.main.config.num_hidden_layers and eng.has_mtp
    check_fp32(*models.mtp_logits(eng, ref))
    models.same_text_with_drafts(eng)


def test_gguf_in_place_and_folder(tiny, tmp_path):
    """Weights are views of the file's mapping (an expert a slice of its stacked tensor); a folder
    holding one .gguf loads as the file does."""
    m, ref = tiny["v3"]
    path = tmp_path / "v3.gguf"
    gguf_files.write(m, path)
    with GGUFCheckpoint(path) as g:
        e = g.tensor("model.layers.1.mlp.experts.5.up_proj.weight")
        whole = g.file.array("blk.1.ffn_up_exps.weight")
        assert np.shares_memory(e, whole) and not e.flags.writeable
        assert np.array_equal(e, whole[5])
    check_fp32(cpumla.load(str(tmp_path)).forward(IDS), ref)


def test_gguf_split_set(tiny, tmp_path):
    m, ref = tiny["v2-lite"]
    one = tmp_path / "one.gguf"
    gguf_files.write(m, one)
    parts = gguf_files.write_split(one, tmp_path / "s", "m", 3)
    check_fp32(cpumla.load(str(parts[1])).forward(IDS), ref)
    parts[2].unlink()
    p = run_cli("smoke", "--model", str(parts[0]))
    assert_one_line_error(p, "shard 3 of 3", parts[2].name, status=2)


def test_gguf_f16_and_bf16(tiny, tmp_path):
    """F16 weights multiply fp32 activations: fp32 parity against the f16 values. BF16 weights round the
    activations (kernels.h): no further from the reference than transformers' own bf16 forward."""
    m, _ = tiny["v3"]
    held = gguf_files.write(m, tmp_path / "f16.gguf", "F16")
    ref16 = gguf_files.reference(models.build("v3", tmp_path / "r16"), held)
    check_fp32(cpumla.load(str(tmp_path / "f16.gguf")).forward(IDS), models.reference_logits(ref16, IDS))
    m, _ = tiny["v2"]
    held = gguf_files.write(m, tmp_path / "bf16.gguf", "BF16")
    rb = gguf_files.reference(models.build("v2", tmp_path / "rb"), held)
    ref = models.reference_logits(rb, IDS)
    hf_bf16 = models.reference_logits(rb.to(torch.bfloat16), IDS)
    check_bf16_drift(cpumla.load(str(tmp_path / "bf16.gguf")).forward(IDS), ref, hf_bf16)


# ---- bad files ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def good(tiny, tmp_path_factory):
    path = tmp_path_factory.mktemp("good") / "v2-lite.gguf"
    gguf_files.write(tiny["v2-lite"][0], path)
    return path


def tensor_info_at(path, name):
    """The byte offset in the file of tensor `name`'s info: its name, dims, type code and data offset."""
    r = gguf.GGUFReader(path)
    t = next(t for t in r.tensors if t.name == name)
    return t.field


@pytest.mark.parametrize("how,words", [
    ("truncated", ["past the end of the file", "blk.2.ffn_down_exps.weight"]),
    ("offset", ["blk.0.attn_norm.weight", "past the end"]),
    ("type", ["blk.0.attn_norm.weight", "type code 99"]),
    ("shape", ["blk.0.attn_output.weight", "shape"]),
    ("metadata", ["deepseek2.block_count", "STRING"]),
    ("missing", ["deepseek2.attention.kv_lora_rank", "missing"]),
    ("garbage", ["not a readable GGUF file"]),
    ("missing-tensor", ["blk.1.attn_kv_a_mqa.weight", "missing"]),
])
def test_bad_gguf(tiny, good, tmp_path, how, words):
    path = tmp_path / "bad.gguf"
    data = bytearray(good.read_bytes())
    m = tiny["v2-lite"][0]
    if how == "truncated":
        data = data[:len(data) - 100]
    elif how in ("offset", "type"):
        f = tensor_info_at(good, "blk.0.attn_norm.weight")
        part = 5 if how == "offset" else 4
        at = f.offset + sum(p.nbytes for p in f.parts[:part])
        value = len(data).to_bytes(8, "little") if how == "offset" else (99).to_bytes(4, "little")
        data[at:at + len(value)] = value
    elif how == "shape":
        gguf_files.write(m, path, transform={"blk.0.attn_output.weight": lambda a: a[:, :32]})
        data = None
    elif how == "metadata":
        gguf_files.write(m, path, metadata={"deepseek2.block_count": "three"})
        data = None
    elif how == "missing":
        gguf_files.write(m, path, metadata={"deepseek2.attention.kv_lora_rank": None})
        data = None
    elif how == "missing-tensor":
        gguf_files.write(m, path, drop=("blk.1.attn_kv_a_mqa.weight",))
        data = None
    else:
        data = b"GGUF" + bytes(60)
    if data is not None:
        path.write_bytes(bytes(data))
    if how not in ("missing-tensor", "shape"):
        words = [str(path), *words]
    with pytest.raises(CpumlaError) as e:
        cpumla.load(str(path))
    for w in words:
        assert w in str(e.value), str(e.value)
    assert_one_line_error(run_cli("smoke", "--model", str(path)), *words, status=2)


@pytest.mark.parametrize("variant", ["v2-lite", "v3"])
def test_gguf_q8_0(tiny, tmp_path, variant):
    """Q8_0 weights (GGUF's blocks, read in place) against transformers fp32 on the values the file holds
    (dequantized by the gguf package). Their products quantize the activations to int8 per block of 32
    (kernels.h), as llama.cpp's do: within a few percent of the largest logit, per-position directions
    within 1 - cos < 1e-2; cached decode equal to the full forward."""
    m, _ = tiny[variant]
    path = tmp_path / "q8.gguf"
    held = gguf_files.write(m, path, "Q8_0")
    assert {gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.F16} <= \
        {t.tensor_type for t in gguf.GGUFReader(path).tensors}
    ref = models.reference_logits(gguf_files.reference(models.build(variant, tmp_path / "ref"), held), IDS)
    gguf_files.check_q8_file(cpumla.load(str(path)), ref, IDS)


def test_gguf_split_kv_b_read_in_place(tmp_path, monkeypatch):
    """attn_k_b / attn_v_b (of a block type here: rows of 32 columns) are read in place from the mapping
    by both forms of the attention (W_UK per head transposed, W_UV): no kv_b is rebuilt, the model holds
    the file's bytes and no more, a decode token reads the pair. Against transformers on the values the
    file holds as any Q8_0 file (decode equal to the full forward); the un-absorbed prefill equal, bit for
    bit, to the same file read through a kv_b rebuilt in fp32."""
    from cpumla.models import deepseek_v2 as v2
    from cpumla.runtime.plan import plan

    kw = {**models.BASE, **models.VARIANTS["v2-lite"][1], "qk_nope_head_dim": 32, "v_head_dim": 32, "kv_lora_rank": 64}
    m = models.build_from_kwargs("deepseek_v2", kw, tmp_path / "hf")
    path = tmp_path / "q8.gguf"
    held = gguf_files.write(m, path, "Q8_0")
    eng = cpumla.load(str(path))
    H, R, n_layers = kw["num_attention_heads"], kw["kv_lora_rank"], kw["num_hidden_layers"]
    with GGUFCheckpoint(path) as g:
        raw = np.array(g.file.raw("blk.1.attn_k_b.weight"))
        assert g.file.entries["blk.1.attn_k_b.weight"].type == "Q8_0"
        file_bytes = sum(e.nbytes for e in g.file.entries.values())
    assert all(L.kv_b is None for L in eng.model.layers)
    L = eng.model.layers[1]
    assert (L.k_b.rows, L.k_b.cols, L.v_b.rows, L.v_b.cols) == (H * R, 32, H * 32, R)
    # the file's blocks as they are, a read-only view of the mapping (a rebuilt copy would be writeable)
    assert L.k_b.dtype == "q8_0" and not L.k_b.data.flags.writeable
    assert np.array_equal(L.k_b.data.reshape(-1), raw.reshape(-1))
    ref = models.reference_logits(gguf_files.reference(models.build_from_kwargs("deepseek_v2", kw, tmp_path / "r"),
                                                       held), IDS)
    gguf_files.check_q8_file(eng, ref, IDS)
    eng.reset()
    got = eng.forward(IDS)
    eng.reset()
    eng.model.mha_min_tokens = 2                   # the prefill un-absorbed, on k_b / v_b
    assert eng.model.unabsorbed(len(IDS))
    got_mha = eng.forward(IDS)
    # the plan (cpumla info): resident the file's bytes (every tensor read in place, nothing rebuilt), and
    # a token's reads as the model counts them
    p = plan(str(path))
    assert p.weights["stored"] == file_bytes
    assert p.token_bytes["stored"] == pytest.approx(eng.model.decode_bytes(0), rel=0.02)

    monkeypatch.setattr(v2, "split_kv_b", lambda cfg, src, layer: (None, None))
    whole = cpumla.load(str(path))
    assert whole.model.layers[1].k_b is None
    kv_b = whole.model.layers[1].kv_b
    assert kv_b.dtype == "f32"
    # per layer a decode token reads k_b and v_b in place of the fp32 kv_b
    saved = n_layers * (kv_b.nbytes - L.k_b.nbytes - L.v_b.nbytes)
    assert whole.model.decode_bytes(0) - eng.model.decode_bytes(0) == pytest.approx(saved)
    with GGUFCheckpoint(path) as g:
        assert g.tensor_nbytes("model.layers.1.self_attn.kv_b_proj.weight") == L.k_b.nbytes + L.v_b.nbytes
    other = whole.forward(IDS)
    # the two differ by the int8 rounding of the absorbed products' activations (kernels.h): as far
    # apart as either is from the reference (3-4% of the largest logit here)
    assert np.abs(got - other).max() < 0.08 * np.abs(other).max()
    cos = (got * other).sum(-1) / np.linalg.norm(got, axis=-1) / np.linalg.norm(other, axis=-1)
    assert (1 - cos).max() < 1e-2
    whole.reset()
    whole.model.mha_min_tokens = 2
    np.testing.assert_array_equal(got_mha, whole.forward(IDS))


def test_the_mtp_file_beside_a_model(tmp_path):
    """Which file beside a model is its MTP file: `mtp-` + its name, else the folder's only `mtp-*.gguf` (a
    split one by its first shard), else none; a folder of a model and its MTP file names the model."""
    from cpumla.checkpoint.gguf import gguf_files, mtp_sidecar

    def files(*names):
        d = tmp_path / str(len(list(tmp_path.iterdir())))
        d.mkdir()
        for n in names:
            (d / n).write_bytes(b"")
        return d

    d = files("m-Q4_K_M.gguf", "mtp-m-Q4_K_M.gguf", "mtp-m-Q8_0.gguf")
    assert mtp_sidecar(d / "m-Q4_K_M.gguf") == d / "mtp-m-Q4_K_M.gguf"
    assert mtp_sidecar(d / "other.gguf") is None                     # two, neither its own name
    d = files("m-Q4_K_M.gguf", "MTP-m-Q8_0.gguf")
    assert mtp_sidecar(d / "m-Q4_K_M.gguf") == d / "MTP-m-Q8_0.gguf"
    assert gguf_files(d) == [d / "m-Q4_K_M.gguf"]
    d = files("m.gguf", "mtp-m-00001-of-00002.gguf", "mtp-m-00002-of-00002.gguf")
    assert mtp_sidecar(d / "m.gguf") == d / "mtp-m-00001-of-00002.gguf"
    assert mtp_sidecar(files("m.gguf") / "m.gguf") is None
