"""Parity with transformers, logits against logits, on tiny random models saved with save_pretrained
(original tensor names) and loaded by cpumla from disk; cached decode against the full forward."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import cpumla
from cpumla import native

from support import models
from support.models import IDS, check_bf16_drift, check_fp32


@pytest.fixture(scope="session")
def saved(tmp_path_factory):
    """variant -> (directory, transformers model, reference logits); fp32 weights."""
    out = {}
    for v in models.VARIANTS:
        d = tmp_path_factory.mktemp(v)
        m = models.build(v, d)
        out[v] = (d, m, models.reference_logits(m, IDS))
    return out


@pytest.mark.parametrize("variant", list(models.VARIANTS))
def test_parity_fp32(saved, variant):
    d, _, ref = saved[variant]
    eng = cpumla.load(str(d))
    check_fp32(eng.forward(IDS), ref)


@pytest.mark.parametrize("variant", ["v2-lite", "v3"])
def test_parity_every_isa(saved, variant, isa):
    d, _, ref = saved[variant]
    check_fp32(cpumla.load(str(d)).forward(IDS), ref)


@pytest.mark.parametrize("variant", list(models.VARIANTS))
def test_cached_decode_matches_full_forward(saved, variant):
    d, _, ref = saved[variant]
    eng = cpumla.load(str(d))
    parts = [eng.forward(IDS[:5])] + [eng.forward([t]) for t in IDS[5:]]
    check_fp32(np.concatenate(parts), ref)
    eng.reset()                                   # a reset cache gives the same answer again
    check_fp32(eng.forward(IDS), ref)


@pytest.mark.parametrize("variant", ["v2", "moonlight"])
def test_parity_bf16(tmp_path, variant):
    """bf16 checkpoint against an fp32 reference from the same rounded weights. cpumla multiplies bf16
    weights by bf16-rounded activations (kernels.h), so it may drift from that reference, but by no
    more than transformers' own bf16 forward of the same model does."""
    m = models.build(variant, tmp_path, dtype=torch.bfloat16)
    ref = models.reference_logits(m, IDS)
    hf_bf16 = models.reference_logits(m.to(torch.bfloat16), IDS)
    check_bf16_drift(cpumla.load(str(tmp_path)).forward(IDS), ref, hf_bf16)


def test_parity_fp8_partial_blocks(saved, tmp_path):
    """FP8 e4m3 with 128x128 weight_scale_inv grids on dims that are not multiples of 128 (every block
    partial; hidden 160 gives two column blocks) against transformers on the dequantised weights in
    fp32. cpumla multiplies the codes by bf16(x * scale) (kernels.h), so it drifts from that reference
    by bf16 rounding, but by no more than transformers' bf16 forward of the same weights does (what
    transformers runs for an FP8 checkpoint on the CPU: the weights dequantised to bf16)."""
    import shutil

    from safetensors.torch import save_file
    from transformers import DeepseekV3ForCausalLM

    src = tmp_path / "f32"
    kw = {**models.BASE, **models.VARIANTS["v3"][1], "hidden_size": 160}
    models.build_from_kwargs("deepseek_v3", kw, src)
    deq = models.quantize_fp8(src, tmp_path / "fp8")
    (tmp_path / "deq").mkdir()                     # the oracle: our dequantised weights, HF format
    shutil.copy(src / "config.json", tmp_path / "deq" / "config.json")
    save_file(deq, tmp_path / "deq" / "model.safetensors", metadata={"format": "pt"})
    ref_model = DeepseekV3ForCausalLM.from_pretrained(tmp_path / "deq", dtype=torch.float32).eval()
    ref = models.reference_logits(ref_model, IDS)
    hf_bf16 = models.reference_logits(ref_model.to(torch.bfloat16), IDS)
    eng = cpumla.load(str(tmp_path / "fp8"))
    assert eng.matmul_format == "e4m3" and eng.bf16_activations
    check_bf16_drift(eng.forward(IDS), ref, hf_bf16)


def test_generate_greedy_is_deterministic(saved):
    d, m, _ = saved["v3"]
    eng = cpumla.load(str(d))
    a = list(eng.generate(IDS[:4], 6, stop_ids=[]))
    eng.reset()
    b = list(eng.generate(IDS[:4], 6, stop_ids=[]))
    assert a == b and len(a) == 6
    with torch.no_grad():          # transformers' greedy continuation of the same prompt
        out = m.generate(torch.tensor([IDS[:4]]), max_new_tokens=6, do_sample=False, eos_token_id=None,
                         pad_token_id=0)
    assert a == out[0, 4:].tolist()


def test_chunked_prefill(saved, monkeypatch):
    """A prompt longer than the prefill chunk goes through in pieces; logits are the same."""
    from cpumla.runtime import engine

    monkeypatch.setattr(engine, "PREFILL_CHUNK", 5)
    d, _, ref = saved["v2"]
    eng = cpumla.load(str(d))
    check_fp32(eng.forward(IDS), ref)
    eng.reset()
    check_fp32(eng.forward(IDS, last_only=True), ref[-1:])


def test_router_logits_fp32_with_bf16_weight(tmp_path):
    """A bf16 checkpoint's MoE router stays bf16 in memory (no widened copy), yet its logits are
    transformers' fp32 ones: cpumla_gemm_f32act keeps the activations unrounded."""
    m = models.build("v2", tmp_path, dtype=torch.bfloat16)
    eng = cpumla.load(str(tmp_path))
    routed = [(i, L) for i, L in enumerate(eng.model.layers) if L.gate is not None]
    assert routed
    rng = np.random.default_rng(3)
    for i, L in routed:
        assert L.gate.dtype == "bf16"
        wt = m.model.layers[i].mlp.gate.weight.detach().float()
        x = rng.standard_normal((5, wt.shape[1])).astype(np.float32)
        want = (torch.from_numpy(x).double() @ wt.double().T).numpy()
        got = native.gemm_f32act(L.gate, x)
        mag = np.abs(x) @ np.abs(wt.numpy()).T
        assert np.abs(got - want).max() <= 2e-6 * mag.max(), np.abs(got - want).max() / mag.max()
    assert eng.matmul_format == "bf16"
