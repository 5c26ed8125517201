"""Folders cpumla writes (checkpoint/output.py, through `cpumla quantize`): `--force` never empties what
is not cpumla's (the current folder, one above it, a folder holding someone's files, the checkpoint
being read, a mount point), a replaced folder is removed only once its successor is in place, and a
failed rename leaves the old one as it was."""

from __future__ import annotations

import json
import os

import pytest

from cpumla import CpumlaError
from cpumla.checkpoint import output
from cpumla.cli import quantize as Q

from support.cli import assert_one_line_error, run_cli, snapshot

V3 = "deepseek-ai/DeepSeek-V3"
TINY = {"num_hidden_layers": 1, "first_k_dense_replace": 1, "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 2, "q_lora_rank": 64, "kv_lora_rank": 32, "vocab_size": 256}


def quantize(out, **kw):
    return Q.quantize_checkpoint(V3, out, "q8", dummy_weights=True, hf_overrides=TINY, **kw)


def users_folder(path):
    path.mkdir(parents=True, exist_ok=True)
    (path / "notes.txt").write_text("mine")
    (path / "sub").mkdir(exist_ok=True)
    (path / "sub" / "more.txt").write_text("also mine")
    return snapshot(path)


@pytest.mark.parametrize("where", [".", "..", "./", "here/..", "../.."])
def test_force_refuses_the_current_folder_and_those_above(tmp_path, monkeypatch, where):
    here = tmp_path / "a" / "b" / "here"
    users_folder(tmp_path / "a")
    before = users_folder(here)
    monkeypatch.chdir(here if where != "here/.." else here.parent)
    with pytest.raises(CpumlaError, match="current folder or one above"):
        quantize(where, force=True)
    assert snapshot(here) == before and (tmp_path / "a" / "notes.txt").read_text() == "mine"


def test_cli_force_dot_is_one_line_and_loses_nothing(tmp_path):
    before = users_folder(tmp_path)
    p = run_cli("quantize", V3, ".", "--quant", "q8", "--force", "--dummy-weights", "--hf-overrides", json.dumps(TINY),
                cwd=tmp_path)
    assert_one_line_error(p, "current folder")
    assert snapshot(tmp_path) == before


def test_force_never_empties_a_folder_cpumla_did_not_write(tmp_path):
    before = users_folder(tmp_path / "theirs")
    with pytest.raises(CpumlaError, match="did not write"):
        quantize(tmp_path / "theirs", force=True)
    assert snapshot(tmp_path / "theirs") == before
    # a symbolic link to it is the folder itself
    (tmp_path / "link").symlink_to(tmp_path / "theirs")
    with pytest.raises(CpumlaError, match="did not write"):
        quantize(tmp_path / "link", force=True)
    assert snapshot(tmp_path / "theirs") == before
    # a file is not a folder
    (tmp_path / "f").write_text("x")
    with pytest.raises(CpumlaError, match="not a folder"):
        quantize(tmp_path / "f", force=True)
    assert (tmp_path / "f").read_text() == "x"


def test_force_replaces_what_cpumla_wrote_and_an_empty_folder(tmp_path):
    out = tmp_path / "out"
    quantize(out)
    assert (out / output.MARK).is_file() and (out / "config.json").is_file()
    (out / "stale.txt").write_text("from before")
    quantize(out, force=True)
    assert not (out / "stale.txt").exists() and (out / "config.json").is_file()
    (tmp_path / "empty").mkdir()
    quantize(tmp_path / "empty", force=True)
    assert (tmp_path / "empty" / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "out"]          # nothing hidden left


def test_a_failed_rename_keeps_the_old_folder(tmp_path, monkeypatch):
    out = tmp_path / "out"
    quantize(out)
    before = snapshot(out)
    real = os.rename

    def rename(a, b):
        if ".partial-" in str(a):
            raise OSError(18, "Invalid cross-device link")
        return real(a, b)

    monkeypatch.setattr(output.os, "rename", rename)
    with pytest.raises(CpumlaError, match="writing failed"):
        quantize(out, force=True)
    assert snapshot(out) == before
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_force_refuses_a_mount_point_and_the_source(tmp_path, monkeypatch):
    out = tmp_path / "mnt"
    quantize(out)
    monkeypatch.setattr(output.os.path, "ismount", lambda p: os.path.realpath(p) == str(out))
    with pytest.raises(CpumlaError, match="mount point"):
        quantize(out, force=True)
    monkeypatch.undo()
    pytest.importorskip("torch")
    from support import models

    src = tmp_path / "src"
    models.build("v2-lite", src)
    before = snapshot(src)
    for target in (src, src / "inner", tmp_path):
        with pytest.raises(CpumlaError, match="overlaps the checkpoint"):
            Q.quantize_checkpoint(str(src), target, "q4", force=True)
    assert snapshot(src) == before and (out / "config.json").is_file()
