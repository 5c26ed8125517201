"""`cpumla smoke`: the default set, one model with overrides, a real checkpoint, bad input; and telling an
expert-routing near-tie (bf16 rounding flipping one token's expert choice) from a cache bug: a decode
step that differs only while routing chooses is called a tie, one that differs whatever the routing is
called a bug."""

from __future__ import annotations

import numpy as np
import pytest

from cpumla.cli import smoke as sm

from support.cli import assert_one_line_error, run_cli

TIE = {"num_hidden_layers": 2, "hidden_size": 1024, "intermediate_size": 2048, "num_attention_heads": 16,
       "num_key_value_heads": 16, "moe_intermediate_size": 256, "n_routed_experts": 16, "first_k_dense_replace": 1}


def test_near_tie_is_reported_as_one(monkeypatch):
    """Decode step 15 moves only while the router picks experts, as a flipped near-tie does (which
    step flips naturally depends on the kernels' summation order, so the flip is made here: the same
    shift of every logit, which leaves the chosen token alone)."""
    from cpumla.runtime.engine import Engine

    real = Engine.forward

    def flipped(self, token_ids, last_only=False):
        out = real(self, token_ids, last_only)
        cfg = self.config
        if len(np.atleast_1d(token_ids)) == 1 and self.pos == 32 + 15 and cfg.num_experts_per_tok < cfg.n_routed_experts:
            out = out + np.float32(0.5) * np.abs(out).max()
        return out

    monkeypatch.setattr(Engine, "forward", flipped)
    r = sm.run("deepseek-ai/DeepSeek-V3", dummy_weights=True, hf_overrides=TIE, seed=0, dummy_dtype="fp8")
    assert r.max_decode_err > 0.05                       # the plain check does fail here
    assert r.status.startswith("ok: expert-routing near-tie") and "step 15)" in r.status and r.passed


def test_a_cache_bug_is_not_called_a_tie(monkeypatch):
    from cpumla.runtime.engine import Engine

    real = Engine.forward

    def stale(self, token_ids, last_only=False):       # decode steps past the prompt see a wrong position
        out = real(self, token_ids, last_only)
        if len(np.atleast_1d(token_ids)) == 1 and self.pos > 40:
            out = out + np.float32(0.5) * np.abs(out).max()
        return out

    monkeypatch.setattr(Engine, "forward", stale)
    r = sm.run("deepseek-ai/DeepSeek-V3", dummy_weights=True, hf_overrides={**sm.SHRINK, "q_lora_rank": 192}, seed=1)
    assert "not a routing tie" in r.status and not r.passed


def test_continuous_routing_removes_every_choice():
    from cpumla.models import family
    from cpumla.runtime.resolve import load_config

    cfg, _ = load_config("deepseek-ai/DeepSeek-V3.2", {**sm.SHRINK, "index_topk": 16})
    ov = sm.continuous_routing(cfg, 49)
    assert ov["num_experts_per_tok"] == 16 and ov["n_group"] == 1 and ov["index_topk"] == 49
    # the tie check's model is loaded like the first: its memory estimate stays that of a small model
    wide, _ = load_config("deepseek-ai/DeepSeek-V3.2", {**sm.SHRINK, "index_topk": 16, **ov})
    assert family(wide.model_type).memory_bytes(wide, 49, "bf16")["scratch"] < 1 << 30


def test_smoke_default_set():
    p = run_cli("smoke", "--dummy-weights", "-n", "16")
    assert p.returncode == 0, p.stderr
    for name in ("DeepSeek-V2-Lite", "DeepSeek-V2", "DeepSeek-V3", "Moonlight-16B-A3B"):
        assert name in p.stdout
    assert p.stdout.count(" ok") >= 4


def test_smoke_vllm_recipe():
    p = run_cli("smoke", "--dummy-weights", "--model", "deepseek-ai/DeepSeek-V2-Lite", "--hf-overrides",
            '{"num_hidden_layers": 2, "n_routed_experts": 4}', "-p", "8", "-n", "16")
    assert p.returncode == 0, p.stderr
    assert "DeepSeek-V2-Lite" in p.stdout and " ok" in p.stdout


def test_smoke_real_checkpoint(v2_lite_dir):
    p = run_cli("smoke", "--model", str(v2_lite_dir), "-p", "8", "-n", "16")
    assert p.returncode == 0 and " ok" in p.stdout, p.stderr


@pytest.mark.parametrize("args,word", [
    (["smoke", "--dummy-weights", "--model", "deepseek-ai/DeepSeek-V3", "--hf-overrides", "{bad"], "not valid JSON"),
    (["smoke", "--dummy-weights", "--model", "deepseek-ai/DeepSeek-V3", "--hf-overrides", '{"nope": 1}'], "nope"),
    (["smoke", "--model", "deepseek-ai/DeepSeek-V3"], "--dummy-weights"),
    (["smoke", "--model", "no-such-org/no-such-model"], "cpumla download"),
    (["smoke"], "--dummy-weights"),
])
def test_smoke_bad_input(args, word):
    assert_one_line_error(run_cli(*args), word)


def test_continuous_routing_of_v4_names_only_its_fields():
    """V4 has no expert groups: the recheck's overrides are fields its config has, and it loads."""
    from cpumla.runtime.resolve import load_config

    v4 = "deepseek-ai/DeepSeek-V4-Flash"
    shrink = {"num_hidden_layers": 2, "n_routed_experts": 16}
    cfg, _ = load_config(v4, shrink)
    ov = sm.continuous_routing(cfg, 40)
    assert "n_group" not in ov and ov["num_experts_per_tok"] == cfg.n_routed_experts
    again, _ = load_config(v4, {**shrink, **ov})
    assert again.num_experts_per_tok == cfg.n_routed_experts
