"""DeepSeek-V3.2 (`deepseek_v32`): V3's MLA plus the DSA lightning indexer, which keeps for each query
only its index_topk best-scored cached keys. Parity with transformers on a tiny random model saved
with save_pretrained (index_topk 6 < 12 tokens, so keys really are dropped): prefill, decode past
index_topk, chunked prefill, bf16 and FP8 checkpoints, multi-turn cache reuse, bad checkpoints, and
engines of different families side by side. The float64 reference of the selection
(reference.dsa_index_scores / dsa_select) is checked against transformers here too.

Top-k selections are discontinuous: a near-tie could flip under any rounding and no tolerance would
then hold. Every fixture asserts that its top-k choices are clear (dsa_margins >= MIN_MARGIN of the
row's largest score, about twice the largest score change bf16-rounded activations cause in these
models) instead of the tests loosening tolerances."""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest
import torch

import cpumla
from cpumla import CpumlaError

from support import models
from support import reference as R
from support.cli import assert_one_line_error, run_cli, snapshot
from support.models import check_bf16_drift, check_fp32

IDS = [3, 17, 99, 5, 150, 42, 7, 7, 120, 64, 1, 33]
MIN_MARGIN = 0.02
INDEXER = ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight")


# ---- the float64 reference of the indexer, fed from a transformers forward ----

def indexer_runs(model, ids, **kw):
    """Runs model on ids; per layer, the list of (x, q_latent, transformers' top-k indices) of each
    indexer call (one per forward)."""
    calls = {i: [] for i in range(len(model.model.layers))}

    def hook(i):
        return lambda mod, args, kwargs, out: calls[i].append((args[0][0].double().numpy(),
                                                                 args[1][0].double().numpy(), out[0].numpy()))

    hs = [L.self_attn.indexer.register_forward_hook(hook(i), with_kwargs=True)
          for i, L in enumerate(model.model.layers)]
    try:
        with torch.no_grad():
            model(torch.tensor([ids]), **kw)
    finally:
        for h in hs:
            h.remove()
    return calls


def reference_scores(model, layer: int, x, q_latent, half_split: bool = True):
    """reference.dsa_index_scores with the layer's weights and the model's rotary frequencies."""
    cfg, ix, rot = model.config, model.model.layers[layer].self_attn.indexer, model.model.rotary_emb
    w = {k: v.detach().double().numpy() for k, v in ix.state_dict().items()}
    if not half_split:                 # the interleaved layout, expressed as a permutation of the rope dims
        P, d = cfg.qk_rope_head_dim, cfg.index_head_dim
        perm = np.r_[np.arange(0, P, 2), np.arange(1, P, 2), np.arange(P, d)]
        w["wk.weight"], w["k_norm.weight"], w["k_norm.bias"] = (w["wk.weight"][perm], w["k_norm.weight"][perm],
                                                                 w["k_norm.bias"][perm])
        w["wq_b.weight"] = w["wq_b.weight"].reshape(cfg.index_n_heads, d, -1)[:, perm].reshape(w["wq_b.weight"].shape)
    return R.dsa_index_scores(x, q_latent, w["wq_b.weight"], w["wk.weight"], w["k_norm.weight"], w["k_norm.bias"],
                              w["weights_proj.weight"], np.arange(x.shape[0]), rot.inv_freq.double().numpy(),
                              cfg.index_n_heads, cfg.qk_rope_head_dim, rot.attention_scaling)


def hf_selection(topk: np.ndarray, t: int) -> set:
    """transformers' choice for query t, without the future keys topk() returns (masked: they are
    picked only when t + 1 < index_topk, and stay masked)."""
    return {int(s) for s in topk if s <= t}


def assert_clear_topk(model, ids):
    """Every layer's top-k choices are far from ties, and the reference picks what transformers picks."""
    K = model.config.index_topk
    for layer, [(x, qr, topk)] in indexer_runs(model, ids).items():
        scores = reference_scores(model, layer, x, qr)
        margins = R.dsa_margins(scores, K)
        assert margins.min() >= MIN_MARGIN, f"layer {layer}: top-k margins {np.round(margins, 4)}"
        sel = R.dsa_select(scores, K)
        assert all(set(sel[t].tolist()) == hf_selection(topk[t], t) for t in range(len(ids))), layer


# ---- fixtures ----

@pytest.fixture(scope="session")
def v32(tmp_path_factory):
    """(directory, transformers model, reference logits) of the fp32 V3.2 fixture."""
    d = tmp_path_factory.mktemp("v32")
    m = models.build_v32(d)
    assert m.config.index_topk < len(IDS) and m.config.model_type == "deepseek_v32"
    assert_clear_topk(m, IDS)
    return d, m, models.reference_logits(m, IDS)


# ---- the reference itself ----

def test_reference_selection_matches_transformers(v32):
    """reference.dsa_index_scores/dsa_select give transformers' top-k in prefill and in every decode
    step (whose indexer scores the new query against all cached indexer keys); reference.yarn_inv_freq
    gives the model's rotary frequencies, which the indexer shares with MLA. The fixture tells the
    indexer's half-split RoPE from MLA's interleaved one, and sparse from dense attention."""
    from transformers import DeepseekV32ForCausalLM, DynamicCache

    d, m, ref = v32
    cfg, K = m.config, m.config.index_topk
    rp = cfg.rope_parameters
    f = R.yarn_inv_freq(cfg.qk_rope_head_dim, rp["rope_theta"], rp["factor"], rp["original_max_position_embeddings"],
                        rp["beta_fast"], rp["beta_slow"])
    np.testing.assert_allclose(f, m.model.rotary_emb.inv_freq.double().numpy(), rtol=1e-6)
    assert m.model.rotary_emb.attention_scaling == 1.0

    full = indexer_runs(m, IDS)
    cache = DynamicCache(config=cfg)
    steps = indexer_runs(m, IDS[:3], cache=cache, use_cache=True)
    for t in range(3, len(IDS)):
        for layer, calls in indexer_runs(m, [IDS[t]], cache=cache, use_cache=True).items():
            steps[layer] += calls
    for layer, [(x, qr, topk)] in full.items():
        scores = reference_scores(m, layer, x, qr)
        sel = R.dsa_select(scores, K)
        assert [hf_selection(topk[t], t) for t in range(len(IDS))] == [set(s.tolist()) for s in sel]
        for t in range(3, len(IDS)):                    # decode: one query, keys 0..t, k = min(K, t + 1)
            step_topk = steps[layer][t - 2][2]
            assert step_topk.shape == (1, min(K, t + 1)) and set(step_topk[0].tolist()) == set(sel[t].tolist())
        interleaved = R.dsa_select(reference_scores(m, layer, x, qr, half_split=False), K)
        assert any(set(a.tolist()) != set(b.tolist()) for a, b in zip(sel, interleaved)), layer

    dense_dir = d.parent / "v32-dense"                  # index_topk >= the sequence: every key is kept
    shutil.copytree(d, dense_dir, dirs_exist_ok=True)
    c = json.loads((dense_dir / "config.json").read_text())
    c["index_topk"] = len(IDS)
    (dense_dir / "config.json").write_text(json.dumps(c))
    dense = models.reference_logits(DeepseekV32ForCausalLM.from_pretrained(dense_dir).eval(), IDS)
    assert np.abs(dense - ref)[K:].max() > 0.1 * np.abs(ref).max()     # the top-k matters from row K on
    np.testing.assert_allclose(dense[:K], ref[:K], atol=1e-5 * np.abs(ref).max())


# ---- parity ----

def test_v32_parity_fp32(v32):
    d, _, ref = v32
    check_fp32(cpumla.load(str(d)).forward(IDS), ref)


@pytest.mark.parametrize("topk", [len(IDS), None], ids=["index_topk=len", "index_topk-absent"])
def test_v32_topk_not_below_sequence_is_dense(v32, tmp_path, topk):
    """index_topk == the sequence length, or absent from config.json (transformers' default 2048):
    every query keeps all its keys (k = min(index_topk, t + 1)), V3 attention. cpumla's logits are
    transformers' for that config."""
    from transformers import DeepseekV32ForCausalLM

    d, _, _ = v32
    shutil.copytree(d, tmp_path / "m")
    c = json.loads((tmp_path / "m" / "config.json").read_text())
    if topk is None:
        del c["index_topk"]
    else:
        c["index_topk"] = topk
    (tmp_path / "m" / "config.json").write_text(json.dumps(c))
    hf = DeepseekV32ForCausalLM.from_pretrained(tmp_path / "m").eval()
    assert hf.config.index_topk == (topk or 2048)
    check_fp32(cpumla.load(str(tmp_path / "m")).forward(IDS), models.reference_logits(hf, IDS))


@pytest.mark.parametrize("prefix", [3, 8], ids=["prefix-below-topk", "prefix-above-topk"])
def test_v32_decode_past_topk(v32, prefix):
    """Prefill a prefix, then one token at a time past index_topk: each step's logits are the full
    forward's row (the indexer scores the new query against every cached token's indexer key)."""
    d, _, ref = v32
    eng = cpumla.load(str(d))
    check_fp32(eng.forward(IDS[:prefix]), ref[:prefix])
    for t in range(prefix, len(IDS)):
        check_fp32(eng.forward([IDS[t]]), ref[t:t + 1])
    eng.reset()
    check_fp32(eng.forward(IDS), ref)


def test_v32_chunked_prefill(v32, monkeypatch):
    """A prompt split into 5-token prefill chunks: the later chunks' queries select among the keys of
    the earlier ones too. Same logits; last_only gives the last row."""
    from cpumla.runtime import engine

    monkeypatch.setattr(engine, "PREFILL_CHUNK", 5)
    d, _, ref = v32
    eng = cpumla.load(str(d))
    check_fp32(eng.forward(IDS), ref)
    eng.reset()
    check_fp32(eng.forward(IDS, last_only=True), ref[-1:])


def test_v32_parity_bf16(tmp_path):
    """bf16 checkpoint against the fp32 reference of the same rounded weights: drift no larger than
    transformers' own bf16 forward's (test_parity.check_bf16_drift)."""
    m = models.build_v32(tmp_path, dtype=torch.bfloat16)
    assert_clear_topk(m, IDS)
    ref = models.reference_logits(m, IDS)
    hf_bf16 = models.reference_logits(m.to(torch.bfloat16), IDS)
    check_bf16_drift(cpumla.load(str(tmp_path)).forward(IDS), ref, hf_bf16)


def test_v32_parity_fp8_partial_blocks(tmp_path):
    """FP8 e4m3 checkpoint as V3.2 ships it: every projection, the indexer's wq_b and wk included, with
    128x128 weight_scale_inv grids over partial blocks (hidden 160: two column blocks; wq_b's 160 rows:
    two row blocks; wk's 20 rows, q LoRA 24: one partial block), the indexer's weights_proj in BF16,
    its k_norm in F32. Against transformers on the dequantised weights in fp32, with
    test_parity.check_bf16_drift's criterion (cpumla multiplies codes by bf16(x * scale))."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    from transformers import DeepseekV32ForCausalLM

    src = tmp_path / "f32"
    models.build_v32(src, seed=models.V32_FP8_SEED, hidden_size=160)
    deq = models.quantize_fp8(src, tmp_path / "fp8")
    p = "model.layers.1.self_attn.indexer."
    with safe_open(tmp_path / "fp8" / "model.safetensors", "pt") as f:
        assert f.get_tensor(p + "wq_b.weight").dtype == torch.float8_e4m3fn
        assert f.get_tensor(p + "wq_b.weight_scale_inv").shape == (2, 1)
        assert f.get_tensor(p + "wk.weight_scale_inv").shape == (1, 2)
        assert f.get_tensor(p + "weights_proj.weight").dtype == torch.bfloat16
        assert p + "weights_proj.weight_scale_inv" not in f.keys()
        assert f.get_tensor(p + "k_norm.bias").dtype == torch.float32
    (tmp_path / "deq").mkdir()
    shutil.copy(src / "config.json", tmp_path / "deq" / "config.json")
    save_file(deq, tmp_path / "deq" / "model.safetensors", metadata={"format": "pt"})
    ref_model = DeepseekV32ForCausalLM.from_pretrained(tmp_path / "deq", dtype=torch.float32).eval()
    assert_clear_topk(ref_model, IDS)
    ref = models.reference_logits(ref_model, IDS)
    hf_bf16 = models.reference_logits(ref_model.to(torch.bfloat16), IDS)
    eng = cpumla.load(str(tmp_path / "fp8"))
    assert eng.matmul_format == "e4m3" and eng.bf16_activations
    check_bf16_drift(eng.forward(IDS), ref, hf_bf16)


@pytest.mark.parametrize("keep", [4, 8], ids=["keep-below-topk", "keep-above-topk"])
def test_v32_multi_turn_reuse(v32, keep):
    """forward(A); truncate(keep); forward(B) is a fresh forward(A[:keep] + B): the indexer keys of
    the dropped turn (other tokens at the same positions) are forgotten with the latent cache."""
    d, _, ref = v32
    a = IDS[:keep] + [11, 140, 2, 77, 150, 9, 30]            # a longer first turn, then regenerated
    b = IDS[keep:]
    eng = cpumla.load(str(d))
    eng.forward(a)
    eng.truncate(keep)
    assert eng.pos == keep
    got = eng.forward(b)
    fresh = cpumla.load(str(d)).forward(IDS)
    check_fp32(got, fresh[keep:])
    check_fp32(got, ref[keep:])


def test_v32_and_other_families_interleaved(v32, tmp_path):
    """A V3.2 engine, a V3 one and a V2-Lite one in one process, their forwards interleaved token by
    token: each gives its own model's logits (no shared per-family state)."""
    d32, _, ref32 = v32
    engines = [(cpumla.load(str(d32)), ref32)]
    for v in ("v3", "v2-lite"):
        m = models.build(v, tmp_path / v)
        engines.append((cpumla.load(str(tmp_path / v)), models.reference_logits(m, IDS)))
    for eng, ref in engines:
        check_fp32(eng.forward(IDS[:4]), ref[:4])
    for t in range(4, len(IDS)):
        for eng, ref in engines:
            check_fp32(eng.forward([IDS[t]]), ref[t:t + 1])
    for eng, ref in engines:             # and prefills one after another
        eng.reset()
    outs = [eng.forward(IDS) for eng, _ in engines]
    for out, (_, ref) in zip(outs, engines):
        check_fp32(out, ref)


# ---- bad checkpoints ----

def bad_v32(src, d, how):
    """A copy of the V3.2 fixture with one thing wrong; returns the word its error must name."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, d)
    st, cj = d / "model.safetensors", d / "config.json"
    cfg = json.loads(cj.read_text())
    if how.startswith("missing-"):
        name = f"model.layers.1.self_attn.indexer.{how[len('missing-'):]}"
        sd = load_file(st)
        del sd[name]
        save_file(sd, st, metadata={"format": "pt"})
        return name
    if how == "wrong-shape-wk":
        name = "model.layers.2.self_attn.indexer.wk.weight"
        sd = load_file(st)
        sd[name] = sd[name][:-1].contiguous()
        save_file(sd, st, metadata={"format": "pt"})
        return name
    if how.startswith("index_topk="):
        cfg["index_topk"] = int(how.split("=")[1])
        cj.write_text(json.dumps(cfg))
        return "index_topk"
    if how == "no-q-lora":                   # the indexer's wq_b reads the q LoRA latent: V3.2 requires it
        cfg["q_lora_rank"] = None
        cj.write_text(json.dumps(cfg))
        return "q_lora_rank"
    raise ValueError(how)


BAD = [f"missing-{n}" for n in INDEXER] + ["wrong-shape-wk", "index_topk=0", "index_topk=-1", "no-q-lora"]


@pytest.mark.parametrize("how", BAD)
def test_v32_bad_checkpoint(v32, tmp_path, how):
    """cpumla.load raises CpumlaError naming the tensor or field; `cpumla smoke --model DIR` exits
    non-zero with that one line (no traceback) and writes nothing into the directory."""
    d = tmp_path / "m"
    word = bad_v32(v32[0], d, how)
    before = snapshot(d)
    with pytest.raises(CpumlaError, match=re.escape(word)) as e:
        cpumla.load(str(d))
    assert "\n" not in str(e.value)
    assert_one_line_error(run_cli("smoke", "--model", str(d), "-p", "8", "-n", "8"), word)
    assert snapshot(d) == before, "the model directory was changed"
