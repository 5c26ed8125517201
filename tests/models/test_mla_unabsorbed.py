"""The DeepSeek-V2/V3 forward with its prefill chunks sent through the un-absorbed MLA attention
(cpumla_mla_mha; the chunk-size threshold lowered to 2) against transformers: prefill then decode,
chunks at depth, chunked prefill, multi-turn reuse, bf16 checkpoints, and a prompt long enough for
several blocks of keys."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import cpumla

from support import models
from support.models import IDS, check_bf16_drift, check_fp32


def unabsorbed_engine(d):
    eng = cpumla.load(str(d))
    eng.model.mha_min_tokens = 2                   # every chunk of two tokens or more
    return eng


def steps(eng, ids, cuts):
    return np.concatenate([eng.forward(ids[a:b]) for a, b in zip((0, *cuts), (*cuts, len(ids)))])


@pytest.mark.parametrize("variant", list(models.VARIANTS))
def test_unabsorbed_prefill_parity(tmp_path, variant):
    """Prefill, a decode step, a chunk at depth, the rest: every chunk of more than one token goes
    un-absorbed, and the logits are transformers'. The absorbed path gives other roundings: the
    threshold really changes the path."""
    m = models.build(variant, tmp_path)
    ref_logits = models.reference_logits(m, IDS)
    eng = unabsorbed_engine(tmp_path)
    assert eng.model.unabsorbed(5) and not eng.model.unabsorbed(1)
    got = steps(eng, IDS, (5, 6, 9))
    check_fp32(got, ref_logits)
    eng.truncate(6)                                 # multi-turn reuse: a new turn after 6 cached tokens
    check_fp32(eng.forward(IDS[6:]), ref_logits[6:])
    absorbed = cpumla.load(str(tmp_path))
    absorbed.model.mha_min_tokens = 1 << 40
    other = steps(absorbed, IDS, (5, 6, 9))
    check_fp32(other, ref_logits)
    assert not np.array_equal(got, other)


def test_unabsorbed_chunked_prefill(tmp_path, monkeypatch):
    from cpumla.runtime import engine

    monkeypatch.setattr(engine, "PREFILL_CHUNK", 5)
    m = models.build("v2-lite", tmp_path)
    ref_logits = models.reference_logits(m, IDS)
    check_fp32(unabsorbed_engine(tmp_path).forward(IDS), ref_logits)


@pytest.mark.parametrize("variant", ["v2", "moonlight"])
def test_unabsorbed_bf16(tmp_path, variant):
    """A bf16 checkpoint (bf16 kv_b: the latents are rounded to bf16 for the decompression, as for
    every bf16 product) drifts from the fp32 reference no more than transformers' bf16 forward does."""
    m = models.build(variant, tmp_path, dtype=torch.bfloat16)
    ref_logits = models.reference_logits(m, IDS)
    hf_bf16 = models.reference_logits(m.to(torch.bfloat16), IDS)
    check_bf16_drift(steps(unabsorbed_engine(tmp_path), IDS, (5, 6, 9)), ref_logits, hf_bf16)


@pytest.mark.parametrize("variant", ["v2-lite", "v3"])
def test_unabsorbed_long_prompt(tmp_path, variant):
    """300 tokens in one chunk (two blocks of keys and of queries), then 40 at depth 300, at the
    default threshold: the first chunk goes un-absorbed, the second absorbed."""
    m = models.build(variant, tmp_path)
    ids = np.random.default_rng(5).integers(0, models.BASE["vocab_size"], 340).tolist()
    ref_logits = models.reference_logits(m, ids)
    eng = cpumla.load(str(tmp_path))
    assert eng.model.unabsorbed(300) and not eng.model.unabsorbed(40)
    check_fp32(steps(eng, ids, (300,)), ref_logits)
