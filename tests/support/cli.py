"""The `cpumla` command as the tests run it: a subprocess with this machine's own implementation
(CPUMLA_ISA removed) and no network (HF_HUB_OFFLINE=1), the one-line error every bad input gets, and a
directory's listing to show it untouched."""

from __future__ import annotations

import os
import subprocess
import sys


def cli_env(**changes) -> dict:
    """The environment of a CLI run: os.environ without CPUMLA_ISA, with HF_HUB_OFFLINE=1, then
    `changes` (a value of None removes the variable)."""
    e = {k: v for k, v in os.environ.items() if k != "CPUMLA_ISA"}
    e["HF_HUB_OFFLINE"] = "1"
    for k, v in changes.items():
        if v is None:
            e.pop(k, None)
        else:
            e[k] = v
    return e


def run_cli(*args, env: dict | None = None, stdin: str | None = None, timeout: float = 300,
            cwd=None) -> subprocess.CompletedProcess:
    """`python -m cpumla *args` (in `cwd` when given); stdout and stderr as text (undecodable bytes
    replaced)."""
    return subprocess.run([sys.executable, "-m", "cpumla", *args], input=stdin, capture_output=True, text=True,
                          errors="replace", env=cli_env() if env is None else env, timeout=timeout, cwd=cwd)


def assert_one_line_error(p: subprocess.CompletedProcess, *words: str, status: int | None = None) -> None:
    """A refusal as every bad input gets it: a non-zero exit (`status` when given), no traceback, one
    `error:` line on stderr holding every word."""
    assert p.returncode != 0 and (status is None or p.returncode == status), (p.returncode, p.stderr)
    assert "Traceback" not in p.stderr + p.stdout
    lines = [line for line in p.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), p.stderr
    for w in words:
        assert w in lines[0], lines[0]


def snapshot(directory) -> list:
    """What a directory holds (names, sizes, modification times), to show that a command left it as it was."""
    return sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in directory.iterdir())
