"""`cpumla smoke`: the default set, one model with overrides, a real checkpoint, bad input; and telling an
expert-routing near-tie (bf16 rounding flipping one token's expert choice) from a cache bug: a decode
step that differs only while routing chooses is called a tie, one that differs whatever the routing is
called a bug."""

from __future__ import annotations

import numpy as np
import pytest

from cpumla.cli import smoke as sm

from support.cli import assert_one_line_error, cli_env, run_cli

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
    # at 80 columns the reason is a footnote under the table, its row a marker
    lines = shown_at_80(monkeypatch, [r])
    assert lines[-3].split()[-2:] == ["ok", "[1]"]
    assert " ".join(lines[-2:]) == "[1] DeepSeek-V3: " + r.status[len("ok: "):]


def shown_at_80(monkeypatch, results) -> list[str]:
    """The lines `cpumla smoke` prints for these results on a terminal 80 columns wide; none is longer,
    and nothing is cut."""
    import io

    from rich.console import Console

    from cpumla.cli import render

    buf = io.StringIO()
    monkeypatch.setattr(render, "out", Console(file=buf, width=80, highlight=False))
    sm.show(results)
    lines = [line.rstrip() for line in buf.getvalue().rstrip("\n").splitlines()]
    assert all(len(line) <= 80 for line in lines) and "…" not in buf.getvalue(), buf.getvalue()
    return lines


def test_statuses_that_need_words_are_footnotes(monkeypatch):
    """Each status that is not a plain ok is a numbered marker in its row and its words once, under the
    table; the rows keep every model's name whole."""
    tie = ("ok: expert-routing near-tie (cached decode differs from the full forward (0.21 at step 3); 0.004 "
           "with every expert routed)")
    bug = ("cached decode differs from the full forward (0.5 at steps 9, 10, 11, 12, ...); not a routing tie "
           "(0.5 with every expert routed)")
    results = [sm.SmokeResult("moonshotai/Moonlight-16B-A3B", "deepseek_v3", 2, 16, 6648.3, 115.1, 2.6e-3, "ok"),
               sm.SmokeResult("deepseek-ai/DeepSeek-V3.2", "deepseek_v32", 2, 16, 12546.4, 156.0, 0.21, tie),
               sm.SmokeResult("/data/DeepSeek-V4-Flash/", "deepseek_v4", 4, 16, 203.7, 34.2, 0.5, bug)]
    lines = shown_at_80(monkeypatch, results)
    rows = {line.split()[0]: line.split() for line in lines if line.split()[0] in
            ("Moonlight-16B-A3B", "DeepSeek-V3.2", "DeepSeek-V4-Flash")}
    assert rows["Moonlight-16B-A3B"][1:] == ["v3", "2", "16", "6648.3", "115.1", "2.6e-03", "ok"]
    assert rows["DeepSeek-V3.2"][1:] == ["v32", "2", "16", "12546.4", "156.0", "2.1e-01", "ok", "[1]"]
    assert rows["DeepSeek-V4-Flash"][-2:] == ["FAILED", "[2]"]
    text = " ".join(lines)
    assert text.count("expert-routing near-tie") == 1 and text.count("not a routing tie") == 1
    notes = text[text.index("[1] DeepSeek-V3.2: "):]
    assert notes == f"[1] DeepSeek-V3.2: {tie[len('ok: '):]} [2] DeepSeek-V4-Flash: {bug}"


def test_smoke_at_80_columns():
    """`cpumla smoke` on a terminal 80 columns wide (COLUMNS=80): no line longer, no name cut, and a
    footnote once for each marker."""
    p = run_cli("smoke", "--dummy-weights", "-n", "8", env=cli_env(COLUMNS="80"))
    assert p.returncode == 0, p.stderr
    lines = p.stdout.rstrip("\n").splitlines()
    assert all(len(line) <= 80 for line in lines) and "…" not in p.stdout, p.stdout
    names = [line.split()[0] for line in lines if line.split() and line.split()[0].startswith(("DeepSeek", "Moon"))]
    assert names == [m.split("/")[-1] for m in sm.DEFAULT_MODELS]
    for n in range(1, 7):
        marker = f"[{n}]"
        assert p.stdout.count(marker) in (0, 2), p.stdout           # in a row, and as its footnote
        assert p.stdout.count(marker) == 0 or any(line.startswith(marker + " ") for line in lines)


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
