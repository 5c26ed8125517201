"""The `cpumla` command as a whole: help, --version (checked against the kernel library built in), and
options that mean the same in every command."""

from __future__ import annotations

import json

from cpumla import __version__
from cpumla.checkpoint.dummy import DUMMY_DTYPES

from support.cli import run_cli

TINY = ["deepseek-ai/DeepSeek-V3", "--dummy-weights", "--hf-overrides",
        json.dumps({"num_hidden_layers": 1, "hidden_size": 128, "n_routed_experts": 8, "first_k_dense_replace": 1,
                    "q_lora_rank": 64, "num_attention_heads": 2})]


def cli(*args):
    p = run_cli(*args)
    return p.returncode, p.stdout, p.stderr


def test_no_args_prints_help():
    p = run_cli()
    assert "Usage" in p.stdout + p.stderr and "info" in p.stdout + p.stderr
    assert "Traceback" not in p.stderr


def test_threads_zero_is_one_rule_everywhere():
    for args in (["chat", *TINY, "-p", "hi"], ["bench", *TINY], ["bench", "--kernels"],
                 ["smoke", "--dummy-weights"], ["info"]):
        rc, _, err = cli(*args, "-t", "0")
        assert rc == 2 and "--threads must be at least 1" in err, (args, err)


def test_help_is_honest_about_flags_and_dummy_dtypes():
    for cmd in ("chat", "smoke", "bench"):
        rc, out, _ = cli(cmd, "--help")
        assert rc == 0
        line = next(l for l in out.splitlines() if "--dummy-weights" in l)
        assert "<bool>" not in line, line
    rc, out, _ = cli("smoke", "--help")
    assert all(d in out for d in DUMMY_DTYPES)
    rc, _, err = cli("smoke", "--dummy-weights", "--model", "deepseek-ai/DeepSeek-V2-Lite", "--dummy-dtype", "int4")
    assert rc == 2 and all(d in err for d in DUMMY_DTYPES)


def test_version_is_checked():
    rc, out, _ = cli("--version")
    assert rc == 0 and out.strip() == f"cpumla {__version__}"
