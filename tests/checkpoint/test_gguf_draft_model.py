"""A GGUF model's MTP file named wherever it lies (`--draft-model`, cpumla.load's draft_model: llama.cpp's
`-md`), and no MTP file opened at all when the drafts are ngram or none. The tiny V3.2 with an MTP layer
(support/models.py: build_v3_mtp), its model file written without the NextN block (the converter's
--no-mtp) and its MTP file (--mtp) under another name in another folder."""

from __future__ import annotations

import json
import shutil

import pytest

import cpumla
from cpumla.errors import CpumlaError

from support import gguf_files, gguf_files_mtp, models
from support.cli import assert_one_line_error, run_cli
from support.models import check_fp32

pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(the model's file, its MTP file elsewhere as draft.gguf, the MTP reference)."""
    d = tmp_path_factory.mktemp("draft-model")
    ref = models.build_v3_mtp(d / "hf", v32=True)
    (d / "model").mkdir()
    (d / "drafts").mkdir()
    gguf_files.write_v32(ref.main, d / "model" / "m.gguf")
    gguf_files_mtp.write_v32_mtp(ref, d / "drafts" / "draft.gguf")
    return d / "model" / "m.gguf", d / "drafts" / "draft.gguf", ref


def bench(*args):
    return run_cli("bench", *map(str, args), "-p", "4", "-n", "4", "-r", "1", "-o", "json")


def test_draft_model_read_from_where_it_is(files):
    """The named MTP file is the MTP layer: drafting on, its logits in fp32 parity with the spec's reference,
    the same greedy text with drafts as without; without it the model has no MTP layer (none beside it);
    `cpumla bench -md` drafts with it."""
    model, draft, ref = files
    eng = cpumla.load(str(model), draft_model=str(draft))
    assert eng.has_mtp and eng.draft == "mtp"
    check_fp32(*models.mtp_logits(eng, ref))
    models.same_text_with_drafts(eng)
    assert not cpumla.load(str(model)).has_mtp
    p = bench(model, "-md", draft)
    assert p.returncode == 0, p.stderr
    rows = [r for r in json.loads(p.stdout) if "draft" in r]
    assert {r["draft"] for r in rows} == {"mtp"} and any(r["test"].startswith("tg accept-all") for r in rows), p.stdout


def test_no_mtp_file_opened_for_ngram_or_none(files, tmp_path):
    """A bad MTP file beside the model stops its load with MTP drafts (cpumla.load's default; bench's is
    none), not with --draft ngram or none: that file is never opened."""
    model, draft, ref = files
    shutil.copy(model, tmp_path / "m.gguf")
    gguf_files_mtp.write_v32_mtp(ref, tmp_path / "mtp-m.gguf", metadata={"deepseek32.block_count": 5})
    with pytest.raises(CpumlaError, match="mtp-m.gguf"):
        cpumla.load(str(tmp_path / "m.gguf"))
    for mode in ("ngram", "none"):
        eng = cpumla.load(str(tmp_path / "m.gguf"), draft=mode)
        assert not eng.has_mtp and eng.draft == mode
    p = bench(tmp_path / "m.gguf", "--draft", "none")
    assert p.returncode == 0, p.stderr
    assert_one_line_error(bench(tmp_path / "m.gguf", "--draft", "mtp"), "mtp-m.gguf", "deepseek32.block_count",
                          status=2)


@pytest.mark.parametrize("case", ["ngram", "missing", "a-model", "in-file", "not-gguf"])
def test_bad_draft_model(files, tmp_path, case):
    """One line, exit 2: --draft-model with ngram drafts, a file that is not there, a model's file (no NextN
    block), a model whose own file holds its MTP layer, a model that is no GGUF."""
    model, draft, ref = files
    kw, args, words = {}, [], ["--draft-model"]
    if case == "ngram":
        kw, args, words = {"draft": "ngram"}, ["--draft", "ngram"], ["--draft-model", "--draft ngram"]
    elif case == "missing":
        draft, words = tmp_path / "nope.gguf", ["--draft-model", "nope.gguf", "no such file"]
    elif case == "a-model":
        draft, words = model, [str(model), "deepseek32.nextn_predict_layers", "is 0"]
    elif case == "in-file":
        model = tmp_path / "with-block.gguf"
        gguf_files.write_v32(ref.main, model, mtp=ref)
        words = [str(model), "holds its MTP layer", "leave out --draft-model"]
    else:
        model, kw, args = "deepseek-ai/DeepSeek-V2-Lite", {"dummy_weights": True}, ["--dummy-weights"]
        words = ["--draft-model", "deepseek-ai/DeepSeek-V2-Lite", "not one"]
    with pytest.raises(CpumlaError) as e:
        cpumla.load(str(model), draft_model=str(draft), **kw)
    for w in words:
        assert w in str(e.value), str(e.value)
    assert_one_line_error(bench(model, "--draft-model", draft, *args), *words, status=2)


def info_json(*args):
    p = run_cli("info", *map(str, args), "--json")
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def test_info_draft_model(files, tmp_path):
    """`cpumla info MODEL -md FILE` plans the named MTP file as it plans one beside the model (its group,
    the weights held), says where it is read from, and refuses it in one line without a GGUF model."""
    model, draft, ref = files
    shutil.copy(model, tmp_path / "m.gguf")
    shutil.copy(draft, tmp_path / "mtp-m.gguf")
    named, beside, alone = info_json(model, "-md", draft), info_json(tmp_path / "m.gguf"), info_json(model)
    assert named["gguf"]["mtp_file"] == str(draft) and alone["gguf"]["mtp_file"] is None
    assert named["gguf"]["groups"] == beside["gguf"]["groups"] and "MTP layer" in named["gguf"]["groups"]
    assert "MTP layer" not in alone["gguf"]["groups"]
    assert named["weights"] == beside["weights"] and named["weights"]["stored"] > alone["weights"]["stored"]
    p = run_cli("info", str(model), "-md", str(draft))
    assert p.returncode == 0 and f"MTP layer from: {draft}" in " ".join(p.stdout.split()), p.stdout
    assert_one_line_error(run_cli("info", "-md", str(draft)), "--draft-model", "MODEL", status=2)
    assert_one_line_error(run_cli("info", "deepseek-ai/DeepSeek-V2-Lite", "-md", str(draft)), "--draft-model",
                          "not one", status=2)
    assert_one_line_error(run_cli("info", str(model), "-md", str(model)), "nextn_predict_layers", status=2)
