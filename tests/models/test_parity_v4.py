"""DeepSeek-V4 against transformers' deepseek_v4 (eager) on tiny random models that hold all three layer
types (sliding window, CSA with its indexer, HCA) and hash-routed layers: full forward, prefill + decode,
chunked prefill, truncate across compression boundaries; the official FP8 + FP4 release format; bad
checkpoints and configs."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

import cpumla
from cpumla.errors import CpumlaError
from cpumla.runtime import engine

from support import models
from support.models import check_bf16_drift, check_fp32

# 44 tokens: 11 CSA windows (ratio 4), 5 HCA windows (ratio 8), five times the sliding window (8), and
# the indexer's top-3 a real selection from the 4th CSA entry on
IDS = [int(t) for t in np.random.default_rng(1).integers(0, 160, 44)]


def index_margins(model, ids, topk):
    """The smallest gap, relative to the largest score, between the k-th and (k+1)-th visible index score
    of any query in any CSA layer of transformers' forward: a selection that no rounding can flip."""
    scores = []
    hooks = [mod.register_forward_hook(lambda _m, _i, out: scores.append(out.detach()))
             for name, mod in model.named_modules() if type(mod).__name__ == "DeepseekV4IndexerScorer"]
    try:
        models.reference_logits(model, ids)
    finally:
        for h in hooks:
            h.remove()
    gaps = []
    for s in scores:
        s = s[0].double().numpy()
        for t in range(s.shape[0]):
            vis = (t + 1) // 4
            if vis > topk:
                v = np.sort(s[t, :vis])[::-1]
                gaps.append((v[topk - 1] - v[topk]) / max(np.abs(v).max(), 1e-30))
    return min(gaps) if gaps else np.inf, len(scores)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(directory saved by save_pretrained, transformers model, reference logits of IDS)."""
    d = tmp_path_factory.mktemp("v4")
    m = models.build_v4(d)
    return d, m, models.reference_logits(m, IDS)


def test_no_index_ties(tiny):
    """The fixture's indexer selections are decided by a clear margin (ReLU makes exact ties easy)."""
    _, m, _ = tiny
    gap, layers = index_margins(m, IDS, models.V4_BASE["index_topk"])
    assert layers == 2 and gap > 1e-3, gap


def test_config_schedule_and_rope(tiny):
    """The layer schedule and both RoPEs (plain on sliding layers, YaRN at compress_rope_theta on
    compressed ones) as transformers derives them, from the config transformers saved."""
    d, m, _ = tiny
    cfg = cpumla.load(str(d)).config
    assert cfg.layer_kinds == m.config.layer_types and cfg.ratios == [0, 4, 8, 4, 8]
    assert cfg.hash == [t == "hash_moe" for t in m.config.mlp_layer_types] == [True, True, False, False, False]
    rot = m.model.rotary_emb
    np.testing.assert_allclose(cfg.main_inv_freq, rot.main_inv_freq.numpy(), rtol=1e-6)
    np.testing.assert_allclose(cfg.compress_inv_freq, rot.compress_inv_freq.numpy(), rtol=1e-6)
    assert cfg.compress_scale == rot.compress_attention_scaling == 1.0


def test_parity_fp32(tiny):
    d, _, ref = tiny
    check_fp32(cpumla.load(str(d)).forward(IDS), ref)


@pytest.mark.parametrize("split", [1, 5, 16, 31, 43])
def test_prefill_then_decode(tiny, split):
    """Prefill of `split` tokens, then one-token decodes: the compressor state (open windows, CSA's
    overlap half) carries across calls; entries emitted by a decode are visible to that same query."""
    d, _, ref = tiny
    eng = cpumla.load(str(d))
    got = np.concatenate([eng.forward(IDS[:split])] + [eng.forward([t]) for t in IDS[split:]])
    check_fp32(got, ref)


def test_chunked_prefill(tiny, monkeypatch):
    """Chunks of 5 and 3 tokens: windows and the ring buffers straddle every chunk boundary."""
    d, _, ref = tiny
    for chunk in (5, 3):
        monkeypatch.setattr(engine, "PREFILL_CHUNK", chunk)
        eng = cpumla.load(str(d))
        check_fp32(eng.forward(IDS), ref)
        eng.reset()
        check_fp32(eng.forward(IDS, last_only=True), ref[-1:])


def test_hf_prefill_decode_agrees(tiny):
    """transformers' own cache path (prefill, then one-token decodes) against its full forward on this
    fixture, so that the decode tests above compare against a reference that is itself consistent."""
    _, m, ref = tiny
    with torch.no_grad():
        out = m(torch.tensor([IDS[:20]]), use_cache=True)
        cache, steps = out.past_key_values if hasattr(out, "past_key_values") else out.cache, [out.logits[0]]
        for t in IDS[20:]:
            out = m(torch.tensor([[t]]), cache=cache, use_cache=True)
            steps.append(out.logits[0])
    check_fp32(torch.cat(steps).numpy(), ref)


@pytest.mark.parametrize("experts", ["fp4", "fp8"])
def test_official_fp8_fp4(tmp_path, experts):
    """The release format read in place (FP8 + E8M0 scales on partial 128x128 blocks, FP4 experts, bf16
    projections and norms) against transformers on the dequantised weights: no further from the fp32
    reference than transformers' own bf16 forward of them (loaded as transformers loads V4, its mHC,
    sinks, norms and biases kept fp32). Every decision here is one that bf16 rounding cannot flip: the
    layers are hash-routed (a biased top-2 of 8 experts has near-ties that bf16's ~1% moves across, in
    transformers' bf16 forward as in ours) and the indexer keeps every entry (index_topk 16 >= 11); the
    biased routing and the sparse selection are checked in fp32 above. With experts fp8: the -Base
    releases' format, routed experts in FP8 like the other linears."""
    from safetensors.torch import save_file
    from transformers import DeepseekV4ForCausalLM

    models.build_v4(tmp_path / "f32", num_hash_layers=5, index_topk=16)
    deq = models.quantize_v4(tmp_path / "f32", tmp_path / "official", {"expert_dtype": experts})
    (tmp_path / "deq").mkdir()
    shutil.copy(tmp_path / "f32" / "config.json", tmp_path / "deq" / "config.json")
    save_file({k: v.contiguous() for k, v in deq.items()}, tmp_path / "deq" / "model.safetensors",
              metadata={"format": "pt"})
    ref = models.reference_logits(DeepseekV4ForCausalLM.from_pretrained(tmp_path / "deq", dtype=torch.float32).eval(), IDS)
    hf_bf16 = models.reference_logits(
        DeepseekV4ForCausalLM.from_pretrained(tmp_path / "deq", dtype=torch.bfloat16).eval(), IDS)
    eng = cpumla.load(str(tmp_path / "official"))
    L = eng.model.layers[1]
    assert (eng.matmul_format, L["experts"]._keep[0][0].dtype, L["attn"][5].dtype) == ("e4m3", {"fp4": "e2m1", "fp8": "e4m3"}[experts], "bf16")
    got = eng.forward(IDS)
    check_bf16_drift(got, ref, hf_bf16)
    eng.reset()                        # and cached decode stays as close
    inc = np.concatenate([eng.forward(IDS[:30])] + [eng.forward([t]) for t in IDS[30:]])
    check_bf16_drift(inc, ref, hf_bf16)
    # the dequantised weights under transformers' names, read by cpumla in fp32: the fp32 reference
    check_fp32(cpumla.load(str(tmp_path / "deq")).forward(IDS), ref)


@pytest.mark.parametrize("keep", [13, 24, 32])
def test_truncate_across_compression_boundaries(tiny, keep):
    """Multi-turn reuse: a first turn runs to 40 tokens; truncating to `keep` (inside an open CSA window,
    on an HCA boundary, past several emitted entries) and appending a different continuation gives the
    logits of a fresh run of the new sequence. The state continues in place (within the rings' reach)."""
    d, _, _ = tiny
    eng = cpumla.load(str(d))
    eng.forward(IDS[:30])
    for t in IDS[30:40]:
        eng.forward([t])
    assert native_resumable(eng, keep)
    eng.truncate(keep)
    new = IDS[keep:] [::-1][:12]
    got = np.concatenate([eng.forward(new[:5])] + [eng.forward([t]) for t in new[5:]])
    fresh = cpumla.load(str(d)).forward(IDS[:keep] + new)[keep:]
    check_fp32(got, fresh)


def native_resumable(eng, pos0):
    from cpumla import native
    return bool(native.lib.cpumla_dsv4_resumable(eng.model._state, pos0))


def test_truncate_beyond_the_rings_replays(tiny, monkeypatch):
    """With 4-token calls the rings reach back only a few positions: a truncate deeper than that replays
    the kept tokens from position 0, and the logits are still those of a fresh run."""
    monkeypatch.setattr(engine, "PREFILL_CHUNK", 4)
    d, _, ref = tiny
    eng = cpumla.load(str(d), max_seq_len=64)
    eng.forward(IDS)
    assert not native_resumable(eng, 9)
    eng.truncate(9)
    check_fp32(eng.forward(IDS[9:]), ref[9:])


def test_hca_at_ratio_128(tmp_path):
    """The released HCA ratio (128, from compress_ratios): 140 tokens cross its first window; prefill to
    the boundary and decode across it."""
    ids = [int(t) for t in np.random.default_rng(2).integers(0, 160, 140)]
    m = models.build_v4(tmp_path, compress_rates=None, num_hidden_layers=3, compress_ratios=[128, 4, 0],
                        index_topk=64)
    ref = models.reference_logits(m, ids)
    eng = cpumla.load(str(tmp_path))
    assert eng.config.ratios == [128, 4, 0]
    check_fp32(eng.forward(ids), ref)
    eng.reset()
    check_fp32(np.concatenate([eng.forward(ids[:126])] + [eng.forward([t]) for t in ids[126:]]), ref)


def _edit(src, dst, drop=None, cfg=None, tensor=None):
    """A copy of checkpoint `src` without tensor `drop`, with config fields `cfg`, tensors `tensor` set."""
    from safetensors.torch import load_file, save_file
    shutil.copytree(src, dst)
    sd = load_file(dst / "model.safetensors")
    sd.pop(drop, None)
    sd.update(tensor or {})
    save_file(sd, dst / "model.safetensors", metadata={"format": "pt"})
    c = json.loads((dst / "config.json").read_text())
    c.update(cfg or {})
    (dst / "config.json").write_text(json.dumps(c))
    return dst


@pytest.mark.parametrize("drop,word", [("model.layers.1.hc_attn_fn", "layers.1.hc_attn_fn"),
                                        ("model.hc_head.hc_base", "hc_head_base"),
                                        ("model.layers.2.attn.attn_sink", "layers.2.attn.attn_sink"),
                                        ("model.layers.1.attn.compressor.wgate.weight", "compressor.wgate"),
                                        ("model.layers.3.attn.indexer.compressor.ape", "indexer.compressor.ape")])
def test_missing_v4_tensor(tiny, tmp_path, drop, word):
    d, _, _ = tiny
    bad = _edit(d, tmp_path / "m", drop=drop)
    with pytest.raises(CpumlaError, match=f"{bad}.*missing tensor '.*{word}"):
        cpumla.load(str(bad))


def test_bad_compress_ratio(tiny, tmp_path):
    d, _, _ = tiny
    c = json.loads((d / "config.json").read_text())
    for k in ("layer_types", "compress_rates"):
        c.pop(k)
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({**c, "compress_ratios": [0, 4, 64, 4, 128]}))
    with pytest.raises(CpumlaError, match=r"config.json: 'compress_ratios' value 64 is not 0, 4 or 128"):
        cpumla.load(str(tmp_path / "m"))


def test_tid2eid_out_of_range(tiny, tmp_path):
    from safetensors.torch import load_file
    d, _, _ = tiny
    t = load_file(d / "model.safetensors")["model.layers.1.ffn.gate.tid2eid"].clone()
    t[7, 1] = 8
    bad = _edit(d, tmp_path / "m", tensor={"model.layers.1.ffn.gate.tid2eid": t})
    with pytest.raises(CpumlaError, match=r"model.safetensors: tensor 'model.layers.1.ffn.gate.tid2eid' names expert 8"):
        cpumla.load(str(bad))


@pytest.mark.parametrize("argv,word", [
    (["smoke", "--model", "{bad}"], "names expert 8"),
])
def test_cli_bad_v4_checkpoint(tiny, tmp_path, argv, word):
    """The CLI prints the one line and exits non-zero."""
    import subprocess
    import sys

    from safetensors.torch import load_file
    d, _, _ = tiny
    t = load_file(d / "model.safetensors")["model.layers.0.ffn.gate.tid2eid"].clone()
    t[0, 0] = 8
    bad = _edit(d, tmp_path / "m", tensor={"model.layers.0.ffn.gate.tid2eid": t})
    r = subprocess.run([sys.executable, "-m", "cpumla"] + [a.format(bad=bad) for a in argv], capture_output=True,
                       text=True)
    assert r.returncode != 0 and word in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
