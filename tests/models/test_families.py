"""The model layer: the family registry, engines of different families side by side (one process, one
or two threads), a model state's lifetime, and V3.2 against V3 on shared weights."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import cpumla
from cpumla import CpumlaError
from cpumla.models import FAMILIES, config_from_dict, family

SMALL = {"num_hidden_layers": 2, "first_k_dense_replace": 1, "hidden_size": 128, "intermediate_size": 256,
         "moe_intermediate_size": 64, "n_routed_experts": 8, "num_attention_heads": 4, "num_key_value_heads": 4,
         "vocab_size": 512}
V32 = {**SMALL, "q_lora_rank": 64, "index_n_heads": 4, "index_head_dim": 64, "index_topk": 6}
IDS = [5, 17, 300, 42, 7, 7, 120, 64, 1, 33, 250, 9, 77, 3]


def load(model, **ov):
    base = V32 if "V3.2" in model else SMALL
    return cpumla.load(model, dummy_weights=True, hf_overrides={**base, **ov}, max_seq_len=64)


def run(eng, ids=IDS, split=6):
    """Prefill the first `split` ids, then decode the rest one by one; all logits."""
    eng.reset()
    return np.concatenate([eng.forward(ids[:split])] + [eng.forward([t]) for t in ids[split:]])


def test_registry():
    assert {"deepseek_v2", "deepseek_v3", "deepseek_v32", "deepseek_v4"} <= set(FAMILIES)
    assert family("deepseek_v4").__name__.endswith("deepseek_v4")
    assert family("deepseek_v3") is family("deepseek_v2")
    assert family("deepseek_v32").__name__.endswith("deepseek_v32")
    for bad, word in [("deepseek_v9", "unsupported model_type"), ("deepseek_v4", "missing field"),
                      (None, "unsupported model_type")]:
        with pytest.raises(CpumlaError, match=word):
            config_from_dict({"model_type": bad}, "x/config.json")


def test_engines_of_different_families_side_by_side():
    """Each engine owns its caches and scratch: interleaving two models' forwards changes nothing."""
    alone = {m: run(load(m)) for m in ("deepseek-ai/DeepSeek-V2-Lite", "deepseek-ai/DeepSeek-V3.2")}
    a, b = load("deepseek-ai/DeepSeek-V2-Lite"), load("deepseek-ai/DeepSeek-V3.2")
    got = {id(a): [a.forward(IDS[:6])], id(b): [b.forward(IDS[:6])]}
    for t in IDS[6:]:
        got[id(b)].append(b.forward([t]))
        got[id(a)].append(a.forward([t]))
    np.testing.assert_array_equal(np.concatenate(got[id(a)]), alone["deepseek-ai/DeepSeek-V2-Lite"])
    np.testing.assert_array_equal(np.concatenate(got[id(b)]), alone["deepseek-ai/DeepSeek-V3.2"])


def test_engines_in_two_threads():
    """Two engines (two families) driven from two Python threads at once give their own answers."""
    models = ["deepseek-ai/DeepSeek-V3", "deepseek-ai/DeepSeek-V3.2"]
    want = {m: run(load(m)) for m in models}
    engines = {m: load(m) for m in models}
    got, errors = {}, []

    def work(m):
        try:
            for _ in range(3):
                got[m] = run(engines[m])
                np.testing.assert_array_equal(got[m], want[m])
        except BaseException as e:      # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(m,)) for m in models]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_one_engine_two_threads_is_serialised():
    """Calls on one engine from two threads take turns: every token lands in the cache once."""
    eng = load("deepseek-ai/DeepSeek-V2-Lite")

    def work(seed):
        rng = np.random.default_rng(seed)
        for _ in range(10):
            eng.forward(rng.integers(0, 512, size=2))

    threads = [threading.Thread(target=work, args=(s,)) for s in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert eng.pos == 40 and len(eng.tokens) == 40
    tokens = list(eng.tokens)
    step = eng.forward([9])[-1]                      # decode over the cache the two threads built
    eng.reset()
    full = eng.forward(tokens + [9])[-1]             # the same tokens in one forward
    assert np.abs(step - full).max() <= 2.0 ** -6 * np.abs(full).max()


def test_close_frees_the_state():
    eng = load("deepseek-ai/DeepSeek-V2-Lite")
    eng.forward([1, 2])
    eng.close()
    eng.close()                                      # twice is fine
    with pytest.raises(CpumlaError, match="closed"):
        eng.forward([3])


def test_v32_equals_v3_while_the_indexer_selects_everything():
    """V3.2's dummy weights are V3's (same names, same seeds) plus the indexer's: with index_topk at
    least the sequence length every query attends to every cached token, so the logits are V3's bit
    for bit; below it they are not."""
    v3 = run(load("deepseek-ai/DeepSeek-V3", q_lora_rank=64))
    dense = run(load("deepseek-ai/DeepSeek-V3.2", index_topk=len(IDS)))
    np.testing.assert_array_equal(dense, v3)
    sparse = run(load("deepseek-ai/DeepSeek-V3.2", index_topk=6))
    np.testing.assert_array_equal(sparse[:6], v3[:6])   # the first 6 queries see at most 6 tokens
    assert np.abs(sparse[6:] - v3[6:]).max() > 1e-3 * np.abs(v3).max()


def test_v32_bench_costs_follow_the_selection():
    """Decode at depth reads latent rows for index_topk tokens only, but every cached index key."""
    eng = load("deepseek-ai/DeepSeek-V3.2")
    cfg, m = eng.config, eng.model
    latent = 4 * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * cfg.num_hidden_layers
    index_key = 4 * cfg.index_head_dim * cfg.num_hidden_layers
    assert m.decode_bytes(3) - m.decode_bytes(2) == pytest.approx(latent + index_key)
    assert m.decode_bytes(1000) - m.decode_bytes(999) == pytest.approx(index_key)
    per_layer = (latent + index_key) // cfg.num_hidden_layers
    assert m.mtp is not None                                # the preset names one: its caches count too
    assert m.cache_bytes_per_token() == per_layer * (cfg.num_hidden_layers + 1)


@pytest.mark.parametrize("ov, word", [
    ({"index_topk": 0}, "index_topk"), ({"index_topk": -3}, "index_topk"), ({"index_topk": 2.5}, "index_topk"),
    ({"index_n_heads": 0}, "index_n_heads"), ({"index_head_dim": 4}, "index_head_dim"),
    ({"q_lora_rank": None}, "q_lora_rank"),
])
def test_v32_bad_config(ov, word):
    with pytest.raises(CpumlaError, match=word) as e:
        load("deepseek-ai/DeepSeek-V3.2", **ov)
    assert "\n" not in str(e.value)
