"""Config values are validated once per family (field, type, range) before anything is derived or
allocated: every bad value is one CpumlaError line naming the field, never a ValueError, TypeError,
ZeroDivisionError, AttributeError or OverflowError traceback, nor NaN logits."""

import pytest

import cpumla
from cpumla.errors import CpumlaError

V2L = "deepseek-ai/DeepSeek-V2-Lite"
V3 = "deepseek-ai/DeepSeek-V3"
V32 = "deepseek-ai/DeepSeek-V3.2"
SMALL = {"num_hidden_layers": 1, "hidden_size": 64, "intermediate_size": 64, "moe_intermediate_size": 32,
         "n_routed_experts": 4, "num_attention_heads": 2, "vocab_size": 128}

BAD = [
    # (model, overrides, field named in the message)
    (V2L, {"hidden_size": -1}, "hidden_size"),
    (V2L, {"hidden_size": 0}, "hidden_size"),
    (V2L, {"hidden_size": 64.5}, "hidden_size"),
    (V2L, {"hidden_size": True}, "hidden_size"),
    (V2L, {"hidden_size": "64"}, "hidden_size"),
    (V2L, {"num_hidden_layers": 0}, "num_hidden_layers"),
    (V2L, {"num_attention_heads": False}, "num_attention_heads"),
    (V2L, {"kv_lora_rank": -3}, "kv_lora_rank"),
    (V2L, {"qk_rope_head_dim": 7}, "qk_rope_head_dim"),
    (V2L, {"v_head_dim": 0.0}, "v_head_dim"),
    (V2L, {"intermediate_size": None}, "intermediate_size"),
    (V2L, {"vocab_size": 2**63}, "vocab_size"),
    (V2L, {"vocab_size": 10**12}, "vocab_size"),
    (V2L, {"n_routed_experts": -1}, "n_routed_experts"),
    (V2L, {"n_routed_experts": 4.0}, "n_routed_experts"),
    (V2L, {"num_experts_per_tok": "6"}, "num_experts_per_tok"),
    (V2L, {"n_shared_experts": [2]}, "n_shared_experts"),
    (V2L, {"first_k_dense_replace": -1}, "first_k_dense_replace"),
    (V2L, {"moe_layer_freq": 0.5}, "moe_layer_freq"),
    (V2L, {"max_position_embeddings": 0}, "max_position_embeddings"),
    (V2L, {"rms_norm_eps": float("nan")}, "rms_norm_eps"),
    (V2L, {"rms_norm_eps": -1e-6}, "rms_norm_eps"),
    (V2L, {"rms_norm_eps": "1e-6"}, "rms_norm_eps"),
    (V2L, {"rope_theta": 0}, "rope_theta"),
    (V2L, {"rope_theta": -1}, "rope_theta"),
    (V2L, {"rope_theta": float("nan")}, "rope_theta"),
    (V2L, {"rope_theta": float("inf")}, "rope_theta"),
    (V2L, {"rope_theta": 1}, "rope_theta"),                 # YaRN divides by log(theta)
    (V2L, {"routed_scaling_factor": float("nan")}, "routed_scaling_factor"),
    (V2L, {"routed_scaling_factor": -2.0}, "routed_scaling_factor"),
    (V2L, {"norm_topk_prob": "yes"}, "norm_topk_prob"),
    (V2L, {"tie_word_embeddings": 1}, "tie_word_embeddings"),
    (V2L, {"topk_method": 3}, "topk_method"),
    (V2L, {"topk_method": "bogus"}, "topk_method"),
    (V2L, {"eos_token_id": "x"}, "eos_token_id"),
    (V2L, {"rope_scaling": "yarn"}, "rope_scaling"),
    (V2L, {"rope_scaling": ["yarn"]}, "rope_scaling"),
    (V2L, {"rope_scaling": {"type": "dynamic"}}, "rope_scaling"),
    (V2L, {"rope_scaling": {"original_max_position_embeddings": None}}, "original_max_position_embeddings"),
    (V2L, {"rope_scaling": {"original_max_position_embeddings": 0}}, "original_max_position_embeddings"),
    (V2L, {"rope_scaling": {"original_max_position_embeddings": 4096.0}}, "original_max_position_embeddings"),
    (V2L, {"rope_scaling": {"factor": 0}}, "factor"),
    (V2L, {"rope_scaling": {"factor": "40"}}, "factor"),
    (V2L, {"rope_scaling": {"factor": float("nan")}}, "factor"),
    (V2L, {"rope_scaling": {"beta_fast": -1}}, "beta_fast"),
    (V2L, {"rope_scaling": {"mscale": float("inf")}}, "mscale"),
    (V2L, {"rope_scaling": {"type": 5}}, "rope_type"),
    (V3, {"quantization_config": "fp8"}, "quantization_config"),
    (V3, {"quantization_config": {"quant_method": "gptq"}}, "gptq"),
    (V3, {"quantization_config": {"weight_block_size": [0, 0]}}, "weight_block_size"),
    (V3, {"quantization_config": {"weight_block_size": [128]}}, "weight_block_size"),
    (V3, {"quantization_config": {"weight_block_size": "x"}}, "weight_block_size"),
    (V3, {"quantization_config": {"weight_block_size": [1e9, 1e9]}}, "weight_block_size"),
    (V3, {"quantization_config": {"weight_block_size": [128.0, 128.0]}}, "weight_block_size"),
    (V3, {"n_group": 3}, "n_group"),
    (V3, {"n_group": 2, "topk_group": 0}, "topk_group"),
    (V32, {"index_topk": 0}, "index_topk"),
    (V32, {"index_n_heads": True}, "index_n_heads"),
    (V32, {"index_head_dim": 2**40}, "index_head_dim"),
]


@pytest.mark.parametrize("model,overrides,field", BAD, ids=lambda v: str(v)[:60] if not isinstance(v, str) else v)
def test_bad_config_values_are_one_line_errors_naming_the_field(model, overrides, field):
    with pytest.raises(CpumlaError) as e:
        cpumla.load(model, dummy_weights=True, hf_overrides={**SMALL, **overrides})
    msg = str(e.value)
    assert field in msg and "\n" not in msg, msg


@pytest.mark.parametrize("model", [V2L, V3, V32])
def test_good_configs_still_load(model):
    eng = cpumla.load(model, dummy_weights=True, hf_overrides=SMALL, max_seq_len=8)
    assert eng.forward([1, 2]).shape == (2, 128)


# ---- one validator, one table per family: every field of every family's table refuses the same bad values
FAMILY_PRESETS = {"deepseek_v2": V2L, "deepseek_v3": V3, "deepseek_v32": V32, "deepseek_v4": "deepseek-ai/DeepSeek-V4-Flash"}


def _rule_cases():
    from cpumla.models import FAMILIES, family

    assert set(FAMILY_PRESETS) == set(FAMILIES), "a family without a preset here is not checked"
    for mt, preset in FAMILY_PRESETS.items():
        C = family(mt).Config
        assert C.SIZES and C.REALS and C.BOOLS, f"{mt}: its Config states no field table"
        for name, (lo, _) in C.SIZES.items():
            for bad in ("abc", True, 1.5, float("nan"), lo - 1, 2**31):
                yield preset, name, bad
        for name, (lo, closed, _) in C.REALS.items():
            for bad in ("abc", True, float("nan"), float("inf"), -float("inf"), lo - 1) + (() if closed else (lo,)):
                yield preset, name, bad
        for name in C.BOOLS:
            for bad in ("yes", 1, None):
                yield preset, name, bad
        for name in C.STRINGS:
            yield preset, name, 3


@pytest.mark.parametrize("preset,name,bad", list(_rule_cases()), ids=lambda v: repr(v)[:40])
def test_every_family_refuses_bad_field_values(preset, name, bad):
    from cpumla.runtime.resolve import load_config

    with pytest.raises(CpumlaError) as e:
        load_config(preset, {name: bad})
    msg = str(e.value)
    assert name in msg and "\n" not in msg, msg


V4 = "deepseek-ai/DeepSeek-V4-Flash"


@pytest.mark.parametrize("overrides,field", [
    ({"rms_norm_eps": "abc"}, "rms_norm_eps"), ({"rope_theta": 0}, "rope_theta"), ({"hc_eps": -1}, "hc_eps"),
    ({"routed_scaling_factor": 0}, "routed_scaling_factor"), ({"swiglu_limit": float("nan")}, "swiglu_limit"),
    ({"compress_rope_theta": float("nan")}, "rope_theta"),
    ({"rope_scaling": {"factor": float("nan")}}, "factor"),
])
def test_v4_config_refused_by_info_with_one_line(overrides, field):
    """`cpumla info` on a config it cannot run: exit 2 and one line naming the field (it said 0 before)."""
    import json

    from support.cli import assert_one_line_error, run_cli

    p = run_cli("info", V4, "--hf-overrides", json.dumps(overrides))
    assert_one_line_error(p, field, status=2)
