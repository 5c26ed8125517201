"""Every numeric option of every command has one rule (cli/options.py's RULES, or the sampler's for the
sampling options), applied before the command runs: a bad value is one line and exit 2, wherever the
option appears."""

from __future__ import annotations

import inspect

import pytest

from cpumla.cli import options
from cpumla.cli.main import app, main

BAD = {"threads": ["0", "-3", "100000"], "seed": ["-1", str(2**64)], "ctx": ["0"], "ctx_size": ["1"],
       "port": ["-1", "70000"], "max_queue": ["-1"], "max_tokens": ["0"], "seconds": ["nan", "inf", "0", "-1"],
       "n_prompt": ["-1"], "n_gen": ["-1"], "reps": ["0"], "rows": ["0"], "cols": ["0"], "stream_mb": ["0"],
       "prompt_tokens": ["0"], "decode_tokens": ["0"], "draft_tokens": ["0", "-2"], "tp": ["0", "65"]}
ARGS = {"chat": ["x"], "serve": ["x"], "quantize": ["x", "y"], "download": ["x"]}   # required arguments


def commands():
    for c in app.registered_commands:
        yield c.name, inspect.signature(c.callback).parameters


def test_every_numeric_option_has_a_rule():
    for name, params in commands():
        for p in params.values():
            if p.annotation in ("int", "float", int, float) and p.name not in options.SAMPLER_OPTIONS:
                assert p.name in options.RULES, f"`{name}` option {options.flag_of(p)} has no rule in RULES"
    assert set(BAD) == set(options.RULES), "every rule is exercised below"


def _cases():
    for name, params in commands():
        for p in params.values():
            if p.name in BAD and p.annotation in ("int", "float", int, float):
                for v in BAD[p.name]:
                    yield name, options.flag_of(p), v


@pytest.mark.parametrize("command,flag,value", list(_cases()))
def test_bad_values_are_one_line_errors(capsys, command, flag, value):
    with pytest.raises(SystemExit) as e:
        main([command, *ARGS.get(command, []), f"{flag}={value}"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and flag in err[0], err


def test_every_option_says_what_it_is():
    """In `--help`: every option has help text, and a flag shows no `<bool>` value it does not take."""
    for name, params in commands():
        for p in params.values():
            info = p.default
            if not hasattr(info, "param_decls") or not any(d.startswith("-") for d in info.param_decls or ()):
                continue                                   # an argument
            flag = options.flag_of(p)
            assert info.help, f"`{name}` option {flag} has no help"
            if p.annotation in ("bool", bool):
                assert info.metavar == "", f"`{name}` flag {flag} shows a <bool> value in --help"


@pytest.mark.parametrize("command", [None] + [name for name, _ in commands()])
def test_help_shows_no_bool_values(capsys, command):
    with pytest.raises(SystemExit) as e:
        main(([command] if command else []) + ["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert "--help" in text and "<bool>" not in text


def test_memory_sizes():
    """--memory's sizes: K/M/G/T are powers of 1024, with or without B / iB, or plain bytes."""
    from cpumla.errors import CpumlaError

    assert options.parse_size("16G") == options.parse_size("16GiB") == options.parse_size("16 gb") == 16 << 30
    assert options.parse_size("1.5T") == 3 << 39 and options.parse_size("512M") == 512 << 20
    assert options.parse_size("800000000") == 800000000 and options.parse_size(None) is None
    for bad in ("lots", "-1G", "0", "G", "1.5X", "1e9", ""):
        with pytest.raises(CpumlaError, match="--memory must be a size"):
            options.parse_size(bad)
