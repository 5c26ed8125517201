"""--model resolution (dir, HF cache, preset), the presets' key values, and hf_overrides (a dict in the
library, JSON text parsed by the CLI's helper)."""

import json
import socket

import pytest

from cpumla.cli.overrides import parse_hf_overrides
from cpumla.errors import CpumlaError
from cpumla.runtime.resolve import PRESETS, Resolved, apply_overrides, preset_config, resolve_model

EXPECTED_PRESETS = [
    "deepseek-ai/DeepSeek-V2-Lite", "deepseek-ai/DeepSeek-V2-Lite-Chat", "deepseek-ai/DeepSeek-V2",
    "deepseek-ai/DeepSeek-V2.5", "deepseek-ai/DeepSeek-V3", "deepseek-ai/DeepSeek-R1",
    "deepseek-ai/DeepSeek-V3.1", "deepseek-ai/DeepSeek-V3.2-Exp", "deepseek-ai/DeepSeek-V3.2",
    "moonshotai/Moonlight-16B-A3B", "moonshotai/Moonlight-16B-A3B-Instruct",
]
V4_PRESETS = ["deepseek-ai/DeepSeek-V4-Flash", "deepseek-ai/DeepSeek-V4-Pro", "deepseek-ai/DeepSeek-V4-Flash-Base",
              "deepseek-ai/DeepSeek-V4-Pro-Base"]
MLA_FIELDS = [
    "model_type", "architectures", "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
    "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "q_lora_rank", "kv_lora_rank",
    "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_routed_experts", "n_shared_experts",
    "num_experts_per_tok", "first_k_dense_replace", "moe_layer_freq", "topk_method", "n_group", "topk_group",
    "scoring_func", "norm_topk_prob", "routed_scaling_factor", "rope_theta", "rope_scaling",
    "max_position_embeddings", "rms_norm_eps", "bos_token_id", "eos_token_id", "tie_word_embeddings",
    "torch_dtype", "hidden_act",
]


@pytest.fixture(autouse=True)
def offline_empty_hub(tmp_path, monkeypatch):
    """Every test sees an empty private HF cache and no network."""
    home = tmp_path / "hf_home"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def no_network(*args, **kwargs):
        raise AssertionError("resolve_model touched the network")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    return home / "hub"


def fake_cached_repo(hub, repo_id, config, rev="0123456789abcdef0123456789abcdef01234567"):
    """The hub cache layout, built by hand: models--org--name/{refs/main, snapshots/<rev>/config.json}."""
    repo = hub / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(rev)
    snap = repo / "snapshots" / rev
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(json.dumps(config))
    return snap


def test_every_preset_is_present_and_complete():
    assert sorted(PRESETS) == sorted(EXPECTED_PRESETS + V4_PRESETS)
    for repo_id in EXPECTED_PRESETS:
        cfg = preset_config(repo_id)
        missing = [f for f in MLA_FIELDS if f not in cfg]
        assert not missing, (repo_id, missing)
        assert cfg["tie_word_embeddings"] is False and cfg["hidden_act"] == "silu"
        assert cfg["num_key_value_heads"] == cfg["num_attention_heads"]
        if cfg["rope_scaling"] is not None:
            assert set(cfg["rope_scaling"]) == {"type", "factor", "original_max_position_embeddings",
                                                "beta_fast", "beta_slow", "mscale", "mscale_all_dim"}


def test_v4_values():
    """V4's presets: the published sizes, the layer schedule (the MTP layer's ratio last) and formats; the
    -Base ones the same architecture with FP8 experts."""
    from cpumla.models import deepseek_v4 as v4

    want = {"deepseek-ai/DeepSeek-V4-Flash": (4096, 43, 64, 1024, 8, 256, 2048, 512, 1.5, [0, 0] + [4, 128] * 20 + [4, 0]),
            "deepseek-ai/DeepSeek-V4-Pro": (7168, 61, 128, 1536, 16, 384, 3072, 1024, 2.5,
                                            [128, 128] + [4, 128] * 29 + [4, 0])}
    for repo, w in [*want.items(), *((r + "-Base", w) for r, w in want.items())]:
        c = preset_config(repo)
        expert = "fp8" if repo.endswith("-Base") else "fp4"
        assert c["model_type"] == "deepseek_v4" and c["architectures"] == ["DeepseekV4ForCausalLM"]
        got = (c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"], c["q_lora_rank"], c["o_groups"],
               c["n_routed_experts"], c["moe_intermediate_size"], c["index_topk"], c["routed_scaling_factor"],
               c["compress_ratios"])
        assert got == w
        assert (c["head_dim"], c["qk_rope_head_dim"], c["o_lora_rank"], c["sliding_window"], c["num_hash_layers"],
                c["hc_mult"], c["expert_dtype"], c["quantization_config"]["scale_fmt"]) == (512, 64, 1024, 128, 3, 4, expert, "ue8m0")
        cfg = v4.Config.from_dict(c)
        assert cfg.expert_kind == {"fp4": "e2m1", "fp8": "e4m3"}[expert]
        assert cfg.ratios == c["compress_ratios"][:-1] and cfg.hash == [True] * 3 + [False] * (cfg.num_hidden_layers - 3)
    with pytest.raises(CpumlaError, match="'expert_dtype' 'int4' is not fp4 or fp8"):
        v4.Config.from_dict({**preset_config("deepseek-ai/DeepSeek-V4-Flash"), "expert_dtype": "int4"})
    # transformers moves the key into quantization_config
    c = preset_config("deepseek-ai/DeepSeek-V4-Flash-Base")
    c["quantization_config"]["expert_dtype"] = c.pop("expert_dtype")
    assert v4.Config.from_dict(c).expert_kind == "e4m3"


def test_v32_values():
    """V3.2's presets: V3.1's architecture with model_type deepseek_v32 and the indexer's real sizes."""
    for repo in ("deepseek-ai/DeepSeek-V3.2-Exp", "deepseek-ai/DeepSeek-V3.2"):
        c = preset_config(repo)
        assert c["model_type"] == "deepseek_v32" and c["architectures"] == ["DeepseekV32ForCausalLM"]
        assert (c["index_n_heads"], c["index_head_dim"], c["index_topk"]) == (64, 128, 2048)
        assert (c["hidden_size"], c["num_hidden_layers"], c["q_lora_rank"], c["n_routed_experts"]) == (7168, 61, 1536, 256)
        assert c["quantization_config"]["weight_block_size"] == [128, 128]


def test_v2_lite_values():
    c = preset_config("deepseek-ai/DeepSeek-V2-Lite")
    assert c["model_type"] == "deepseek_v2" and c["architectures"] == ["DeepseekV2ForCausalLM"]
    assert (c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"]) == (2048, 27, 16)
    assert c["q_lora_rank"] is None and c["kv_lora_rank"] == 512
    assert (c["topk_method"], c["n_group"], c["topk_group"]) == ("greedy", 1, 1)
    assert (c["scoring_func"], c["norm_topk_prob"], c["routed_scaling_factor"]) == ("softmax", False, 1.0)
    assert (c["n_routed_experts"], c["n_shared_experts"], c["num_experts_per_tok"]) == (64, 2, 6)
    assert c["rope_scaling"]["factor"] == 40 and c["rope_scaling"]["mscale_all_dim"] == 0.707
    assert (c["bos_token_id"], c["eos_token_id"], c["vocab_size"]) == (100000, 100001, 102400)
    assert "quantization_config" not in c


def test_v2_values():
    c = preset_config("deepseek-ai/DeepSeek-V2")
    assert (c["hidden_size"], c["num_hidden_layers"], c["q_lora_rank"]) == (5120, 60, 1536)
    assert (c["topk_method"], c["n_group"], c["topk_group"]) == ("group_limited_greedy", 8, 3)
    assert (c["n_routed_experts"], c["routed_scaling_factor"]) == (160, 16.0)


def test_v3_family_values():
    for repo_id in ("deepseek-ai/DeepSeek-V3", "deepseek-ai/DeepSeek-R1", "deepseek-ai/DeepSeek-V3.1"):
        c = preset_config(repo_id)
        assert c["model_type"] == "deepseek_v3"
        assert (c["hidden_size"], c["num_hidden_layers"], c["vocab_size"]) == (7168, 61, 129280)
        assert (c["topk_method"], c["n_group"], c["topk_group"]) == ("noaux_tc", 8, 4)
        assert (c["n_routed_experts"], c["num_experts_per_tok"], c["routed_scaling_factor"]) == (256, 8, 2.5)
        assert (c["scoring_func"], c["norm_topk_prob"], c["first_k_dense_replace"]) == ("sigmoid", True, 3)
        assert c["num_nextn_predict_layers"] == 1 and c["rope_scaling"]["mscale"] == 1.0
        q = c["quantization_config"]
        assert (q["quant_method"], q["fmt"], q["weight_block_size"]) == ("fp8", "e4m3", [128, 128])
        assert (q.get("scale_fmt") == "ue8m0") == (repo_id.endswith("V3.1"))


def test_moonlight_values():
    for repo_id in ("moonshotai/Moonlight-16B-A3B", "moonshotai/Moonlight-16B-A3B-Instruct"):
        c = preset_config(repo_id)
        assert (c["vocab_size"], c["rope_theta"], c["rms_norm_eps"]) == (163840, 50000, 1e-5)
        assert (c["n_group"], c["topk_group"], c["q_lora_rank"], c["rope_scaling"]) == (1, 1, None, None)
        assert (c["routed_scaling_factor"], c["max_position_embeddings"]) == (2.446, 8192)
        assert c["num_nextn_predict_layers"] == 0 and "quantization_config" not in c


def test_preset_lookup_is_case_insensitive_and_unknown_is_an_error():
    assert resolve_model("DEEPSEEK-AI/deepseek-v3").repo_id == "deepseek-ai/DeepSeek-V3"
    with pytest.raises(CpumlaError, match="not a known preset"):
        preset_config("org/unknown")


def test_local_directory(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "deepseek_v2", "hidden_size": 8}))
    r = resolve_model(str(d))
    assert r == Resolved("dir", d.resolve(), None, {"model_type": "deepseek_v2", "hidden_size": 8})


def test_local_directory_without_config(tmp_path):
    with pytest.raises(CpumlaError, match="has no config.json") as err:
        resolve_model(str(tmp_path))
    assert str(tmp_path) in str(err.value)


def test_invalid_config_json_names_file_and_position(tmp_path):
    (tmp_path / "config.json").write_text('{\n  "hidden_size": 8,\n  "vocab_size": \n}')
    with pytest.raises(CpumlaError, match=r"config.json: invalid JSON at line 4 column 1") as err:
        resolve_model(str(tmp_path))
    assert str(tmp_path / "config.json") in str(err.value)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(CpumlaError, match="not an object"):
        resolve_model(str(tmp_path))


def test_missing_path_is_not_mistaken_for_a_repo(tmp_path):
    with pytest.raises(CpumlaError, match="no such directory"):
        resolve_model(str(tmp_path / "nope" / "model"))


def test_hf_cache_hit(offline_empty_hub):
    cfg = {"model_type": "deepseek_v3", "hidden_size": 16}
    snap = fake_cached_repo(offline_empty_hub, "someorg/tiny-mla", cfg)
    r = resolve_model("someorg/tiny-mla")
    assert (r.kind, r.directory, r.repo_id, r.config) == ("cache", snap, "someorg/tiny-mla", cfg)


def test_hf_cache_wins_over_preset(offline_empty_hub):
    cfg = preset_config("deepseek-ai/DeepSeek-V2-Lite") | {"num_hidden_layers": 2}
    fake_cached_repo(offline_empty_hub, "deepseek-ai/DeepSeek-V2-Lite", cfg)
    r = resolve_model("deepseek-ai/DeepSeek-V2-Lite")
    assert r.kind == "cache" and r.config["num_hidden_layers"] == 2


def test_preset_fallback():
    r = resolve_model("moonshotai/Moonlight-16B-A3B")
    assert (r.kind, r.directory, r.repo_id) == ("preset", None, "moonshotai/Moonlight-16B-A3B")
    assert r.config["vocab_size"] == 163840


def test_unknown_repo_says_how_to_download(offline_empty_hub):
    for name in ("someorg/not-here", "plainname"):
        with pytest.raises(CpumlaError) as err:
            resolve_model(name)
        msg = str(err.value)
        assert f"`cpumla download {name}`" in msg and "not in the Hugging Face cache" in msg
        assert f"HF_HOME={offline_empty_hub.parent}" in msg and "deepseek-ai/DeepSeek-V3" in msg


def test_overrides_merge_into_a_copy():
    base = preset_config("deepseek-ai/DeepSeek-V2-Lite")
    out = apply_overrides(base, {"num_hidden_layers": 2, "rope_scaling": {"factor": 4}})
    assert out["num_hidden_layers"] == 2 and out["rope_scaling"]["factor"] == 4
    assert out["rope_scaling"]["mscale"] == 0.707  # nested dicts merge key-wise
    assert base["num_hidden_layers"] == 27 and base["rope_scaling"]["factor"] == 40  # input untouched
    out = apply_overrides(base, {"rope_scaling": None, "q_lora_rank": 1536})
    assert out["rope_scaling"] is None and out["q_lora_rank"] == 1536
    moon = preset_config("moonshotai/Moonlight-16B-A3B")
    yarn = {"type": "yarn", "factor": 2.0}
    assert apply_overrides(moon, {"rope_scaling": yarn})["rope_scaling"] == yarn
    assert apply_overrides(base, None) == base and apply_overrides(base, {}) == base


@pytest.mark.parametrize("bad, message", [
    ('{"num_hidden_layers": 2}', "hf_overrides must be a dict, not a str (the CLI parses JSON)"),
    ("", "hf_overrides must be a dict, not a str"),
    ([1, 2], "hf_overrides must be a dict, not a list"),
    ({"xyz": 1}, "--hf-overrides: config has no field 'xyz'"),
])
def test_bad_overrides(bad, message):
    """The library takes a dict (or None); JSON text is the CLI's to parse."""
    with pytest.raises(CpumlaError) as err:
        apply_overrides(preset_config("deepseek-ai/DeepSeek-V3"), bad)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_cli_parses_overrides_json():
    assert parse_hf_overrides('{"num_hidden_layers": 2, "rope_scaling": {"factor": 4}}') == \
        {"num_hidden_layers": 2, "rope_scaling": {"factor": 4}}
    assert parse_hf_overrides(None) == {} and parse_hf_overrides("  ") == {}


@pytest.mark.parametrize("bad, message", [
    ('{"num_hidden_layers": 2', "--hf-overrides is not valid JSON"),
    ("[1, 2]", "--hf-overrides must be a JSON object, not a list"),
    ('"x"', "--hf-overrides must be a JSON object, not a str"),
])
def test_cli_bad_overrides_json(bad, message):
    with pytest.raises(CpumlaError) as err:
        parse_hf_overrides(bad)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)
