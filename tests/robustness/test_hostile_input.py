"""Hostile input ends in one CpumlaError line (the CLI: one 'error:' line on stderr, exit 2): JSON
nested 50k deep or with 5000-digit integers anywhere JSON is read, Rich markup, newlines and ESC
sequences in paths, override keys and tensor names, and token ids of the wrong kind."""

import json
import os
import struct
import subprocess
import sys

import numpy as np
import pytest

import cpumla
from cpumla.cli.overrides import parse_hf_overrides
from cpumla.errors import CpumlaError
from cpumla.runtime.resolve import preset_config

from support.cli import assert_one_line_error, run_cli

DEEP = "[" * 50000 + "]" * 50000
DEEP_OBJ = '{"a":' * 50000 + "1" + "}" * 50000
LONG_INT = "1" * 5000
NASTY = "x[/]y[nan][link=http://e.x]z\n\x1b[2J\u2028w"


def cli(*args):
    return run_cli(*args, timeout=60)


def one_error_line(r):
    """The one error line of a refusal (exit 2), with no terminal escape let through."""
    assert_one_line_error(r, status=2)
    assert "\x1b" not in r.stderr
    return r.stderr.strip()


def write_safetensors(path, header: bytes, data: bytes = b"", pad: int = 0):
    header = header + b" " * pad
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)


@pytest.mark.parametrize("text", [DEEP, DEEP_OBJ, '{"vocab_size": ' + LONG_INT + "}", '{"a": ' + "[" * 100 + "]" * 100 + "}"],
                         ids=["deep-list", "deep-object", "long-int", "deep-in-a-field"])
def test_config_json_limits(tmp_path, text):
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(CpumlaError) as e:
        cpumla.load(str(tmp_path))
    assert "\n" not in str(e.value) and "config.json" in str(e.value)


@pytest.mark.parametrize("text", [DEEP_OBJ, '{"t": {"dtype": "F32", "shape": [' + LONG_INT + '], "data_offsets": [0, 4]}}'],
                         ids=["deep", "long-int"])
def test_safetensors_header_json_limits(tmp_path, text):
    from cpumla.checkpoint.safetensors import SafetensorsFile

    f = tmp_path / "model.safetensors"
    write_safetensors(f, text.encode())
    with pytest.raises(CpumlaError) as e:
        SafetensorsFile(f)
    assert "\n" not in str(e.value) and "model.safetensors" in str(e.value)


@pytest.mark.parametrize("text", [DEEP_OBJ, '{"weight_map": {"a": ' + LONG_INT + "}}"], ids=["deep", "long-int"])
def test_index_json_limits(tmp_path, text):
    from cpumla.checkpoint.safetensors import Checkpoint

    (tmp_path / "model.safetensors.index.json").write_text(text)
    with pytest.raises(CpumlaError) as e:
        Checkpoint(tmp_path)
    assert "\n" not in str(e.value)


CLI_DEEP = "[" * 5000 + "]" * 5000          # an argument is at most 128 KiB


@pytest.mark.parametrize("text", [DEEP, DEEP_OBJ, CLI_DEEP, '{"vocab_size": ' + LONG_INT + "}",
                                  '{"rope_scaling": ' + '{"a": ' * 200 + "1" + "}" * 200 + "}"],
                         ids=["deep-list", "deep-object", "cli-deep", "long-int", "deep-in-a-field"])
def test_hf_overrides_json_limits(text):
    with pytest.raises(CpumlaError):
        parse_hf_overrides(text)
    if len(text) < 100_000:
            one_error_line(cli("smoke", "--dummy-weights", "-m", "deepseek-ai/DeepSeek-V2-Lite", "--hf-overrides", text))


def test_deep_python_overrides():
    d = v = {}
    for _ in range(50000):
        v["rope_scaling"] = {}
        v = v["rope_scaling"]
    with pytest.raises(CpumlaError, match="nested"):
        cpumla.load("deepseek-ai/DeepSeek-V2-Lite", dummy_weights=True, hf_overrides=d)


def test_markup_and_control_characters_in_a_path(tmp_path):
    d = tmp_path / "x[" / "]y[nan][link=e.x]z\n\x1b[2J\u2028w"
    d.mkdir(parents=True)
    line = one_error_line(cli("smoke", "-m", str(d)))
    assert "x[/]y[nan][link=e.x]z\\n\\x1b[2J\\u2028w" in line


def test_markup_and_control_characters_in_an_override_key():
    line = one_error_line(cli("smoke", "--dummy-weights", "-m", "deepseek-ai/DeepSeek-V2-Lite",
                              "--hf-overrides", json.dumps({NASTY: 1})))
    assert "[nan]" in line and "[/]" in line and "\\n" in line


def test_markup_and_control_characters_in_a_tensor_name(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(preset_config("deepseek-ai/DeepSeek-V2-Lite")))
    write_safetensors(tmp_path / "model.safetensors",
                      json.dumps({NASTY: {"dtype": "F99", "shape": [1], "data_offsets": [0, 4]}}).encode(), b"\0" * 4)
    line = one_error_line(cli("smoke", "-m", str(tmp_path)))
    assert "[link=http://e.x]" in line and "\\x1b[2J" in line


def test_print_error_keeps_markup_literal(capsys):
    from cpumla.cli import render

    render.print_error("a [/] b [nan] [bold]c")
    render.print_warning("[/]\n")
    err = capsys.readouterr().err
    assert "a [/] b [nan] [bold]c" in err and "[/]\\n" in err


def test_closed_stdout():
    r = subprocess.run(f"{sys.executable} -m cpumla info >&-", shell=True, capture_output=True, text=True,
                       timeout=60, env=os.environ)
    assert "Traceback" not in r.stderr, r.stderr


@pytest.fixture(scope="module")
def eng():
    return cpumla.load("deepseek-ai/DeepSeek-V2-Lite", dummy_weights=True, max_seq_len=64,
                       hf_overrides={"num_hidden_layers": 1, "n_routed_experts": 4, "hidden_size": 64,
                                     "num_attention_heads": 2, "intermediate_size": 64, "moe_intermediate_size": 32})


@pytest.mark.parametrize("ids,msg", [
    (np.array([1.0, 2.0]), "integers"), ([1.5], "integers"), (np.array([[1, 2], [3, 4]]), "one sequence"),
    ([[1, 2]], "one sequence"), (["1"], "integers"), ([True], "integers"), (True, "bool"),
    (np.array([2**64 - 1], np.uint64), "18446744073709551615"), ([2**70], str(2**70)), ([-1], "-1"),
    ([102400], "102400"),
])
def test_bad_token_ids(eng, ids, msg):
    eng.reset()
    with pytest.raises(CpumlaError, match=msg):
        eng.forward(ids)
    assert eng.pos == 0


@pytest.mark.parametrize("ids", [[1, 2], 7, np.array([3, 4], np.int32), np.array([5], np.uint64), (np.int64(9),)])
def test_integer_token_ids(eng, ids):
    eng.reset()
    assert np.isfinite(eng.forward(ids)).all()


def _pad_header(src, dst, pad):
    raw = src.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = raw[8:8 + n].rstrip(b" ") + b" " * pad
    dst.write_bytes(struct.pack("<Q", len(header)) + header + raw[8 + n:])


@pytest.mark.parametrize("pad", [1, 2, 3])
def test_misaligned_tensor_data_gives_the_same_logits(tmp_path, pad):
    """A header padded to an odd length leaves every tensor misaligned: they are copied aligned at load
    (run under UBSan by `make test-sanitize`, which reports any misaligned load)."""
    pytest.importorskip("torch")
    import shutil

    from cpumla.checkpoint.safetensors import SafetensorsFile

    from support import models

    good = tmp_path / "good"
    models.build("v3", good)
    bad = tmp_path / "bad"
    shutil.copytree(good, bad)
    _pad_header(good / "model.safetensors", bad / "model.safetensors", pad)
    with SafetensorsFile(bad / "model.safetensors") as f:
        name = next(n for n in f.keys() if f.info(n)[0] == "F32")
        assert f.tensor(name).flags.aligned
        assert (f.tensor(name) == SafetensorsFile(good / "model.safetensors").tensor(name)).all()
    ids = [1, 5, 7, 9]
    want = cpumla.load(str(good)).forward(ids)
    got = cpumla.load(str(bad)).forward(ids)
    np.testing.assert_array_equal(got, want)
