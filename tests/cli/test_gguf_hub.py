"""`cpumla download REPO:QUANT`, `cpumla list` and `cpumla info REPO:QUANT` with GGUF repos: a fake hub
(HfApi.model_info and snapshot_download replaced in process; the fake writes the files it is asked for
into a temporary hub cache as huggingface_hub lays it out), then the CLI over that cache offline. No
network anywhere."""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from support.cli import assert_one_line_error, cli_env, run_cli

hf = pytest.importorskip("huggingface_hub")
gguf = pytest.importorskip("gguf")

REPO, TWO, ST = "test-org/Tiny-GGUF", "test-org/Two-GGUF", "test-org/Tiny-ST"


def write_gguf(path: Path, arch: str = "deepseek2", tensors: int = 3, fill: int = 0) -> None:
    """A small GGUF file (not a runnable model): `tensors` F32 tensors [4, 32 + fill]."""
    w = gguf.GGUFWriter(str(path), arch)
    for i in range(tensors):
        w.add_tensor(f"blk.{i}.ffn_up_exps.weight", np.full((4, 32 + fill), i, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_mtp(path: Path, cfg) -> None:
    """An MTP file of the tiny model of config cfg as the loader checks one (checkpoint/gguf_model.py:
    check_sidecar): its NextN block's eh_proj alone (a V2-Lite reads no MTP layer)."""
    from support.gguf_files import add

    w = gguf.GGUFWriter(str(path), "deepseek2")
    for key, value in (("block_count", cfg.num_hidden_layers + 1), ("nextn_predict_layers", 1),
                       ("embedding_length", cfg.hidden_size)):
        add(w, "deepseek2." + key, value)
    D = cfg.hidden_size
    w.add_tensor(f"blk.{cfg.num_hidden_layers}.nextn.eh_proj.weight", np.zeros((D, 2 * D), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def repos(tmp_path_factory):
    """{repo id: {path in the repo: bytes}}: a GGUF repo with single files, a split set in a folder, a UD
    set, Q2_K beside UD-Q2_K_XL, an mmproj file, an MTP file (llama.cpp's `mtp-` + a model's name: no model
    of its own); a repo holding Q4_K_M twice; a safetensors repo."""
    from support import gguf_files, models

    d = tmp_path_factory.mktemp("gguf")
    model = models.build("v2-lite", d / "hf")
    files = {}
    for name, qtype in (("Tiny-Q8_0.gguf", "Q8_0"), ("Tiny-F16.gguf", "F16")):
        gguf_files.write(model, d / name, qtype)
        files[name] = (d / name).read_bytes()
    gguf_files.write(model, d / "whole.gguf", "Q8_0")
    for folder, stem, n in (("Q4_K_M", "Tiny-Q4_K_M", 3), ("UD-Q2_K_XL", "Tiny-UD-Q2_K_XL", 2)):
        for f in gguf_files.write_split(d / "whole.gguf", d / folder, stem, n):
            files[f"{folder}/{f.name}"] = f.read_bytes()
    for name, arch, fill in (("Tiny-Q2_K.gguf", "deepseek2", 1), ("mmproj-Tiny-F16.gguf", "clip", 2)):
        write_gguf(d / name, arch, fill=fill)
        files[name] = (d / name).read_bytes()
    write_mtp(d / "mtp.gguf", model.config)
    files["Q4_K_M/mtp-Tiny-Q4_K_M.gguf"] = (d / "mtp.gguf").read_bytes()
    files |= {"README.md": b"# tiny\n", ".gitattributes": b"*.gguf filter=lfs\n"}
    write_gguf(d / "two.gguf", fill=3)
    two = {"a/M-Q4_K_M.gguf": (d / "two.gguf").read_bytes(), "b/M-Q4_K_M.gguf": (d / "two.gguf").read_bytes()[:-1]}
    st = {"config.json": b'{"model_type": "deepseek_v3"}', "model.safetensors": b"\0" * 64,
          "tokenizer.json": b"{}", "pytorch_model.bin": b"\0" * 8, "README.md": b""}
    return {REPO: files, TWO: two, ST: st}


def sha(repo_id: str) -> str:
    return hashlib.sha1(repo_id.encode()).hexdigest()


def put(hub: Path, repo_id: str, files: dict[str, bytes]) -> Path:
    """Files into the hub cache as huggingface_hub writes them: blobs by hash, snapshot links, refs/main."""
    repo = hub / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / sha(repo_id)
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(sha(repo_id))
    for name, data in files.items():
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = snap / name
        link.parent.mkdir(parents=True, exist_ok=True)
        if not link.is_symlink():
            link.symlink_to(Path(*[".."] * (len(Path(name).parts) + 1), "blobs", blob.name))
    return snap


class FakeHub:
    """HfApi.model_info and snapshot_download over `repos`; `fetched` records each download's files."""

    def __init__(self, repos, hub: Path):
        self.repos, self.hub, self.fetched, self.patterns = repos, hub, [], []

    def model_info(self, api, repo_id, *, revision=None, files_metadata=False, **kw):
        if repo_id not in self.repos:
            e = hf.errors.RepositoryNotFoundError.__new__(hf.errors.RepositoryNotFoundError)
            Exception.__init__(e, f"404 Client Error: Repository Not Found for url: .../{repo_id}")
            raise e
        return SimpleNamespace(sha=sha(repo_id), siblings=[
            hf.hf_api.RepoSibling(rfilename=p, size=len(b) if files_metadata else None)
            for p, b in self.repos[repo_id].items()])

    def snapshot_download(self, repo_id, *, revision=None, cache_dir=None, allow_patterns=None,
                          local_files_only=False, **kw):
        assert not local_files_only and Path(cache_dir) == self.hub
        files = self.repos[repo_id]
        chosen = sorted(hf.utils.filter_repo_objects(list(files), allow_patterns=allow_patterns))
        self.fetched.append(chosen)
        self.patterns.append(allow_patterns)
        return str(put(self.hub, repo_id, {p: files[p] for p in chosen}))


@pytest.fixture
def fake(repos, tmp_path, monkeypatch):
    hub = tmp_path / "hub"
    f = FakeHub(repos, hub)
    monkeypatch.setattr(hf.HfApi, "model_info", lambda api, repo_id, **kw: f.model_info(api, repo_id, **kw))
    monkeypatch.setattr(hf, "snapshot_download", f.snapshot_download)
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.delenv("HF_HOME", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    return f


def cli(capsys, *args) -> subprocess.CompletedProcess:
    """The CLI in this process (so that the fake hub serves it), its tables wide enough for any path."""
    from cpumla.cli import render
    from cpumla.cli.main import main

    width = render.out.width
    render.out.width = 1000
    try:
        with pytest.raises(SystemExit) as e:
            main(list(args))
    finally:
        render.out.width = width
    got = capsys.readouterr()
    return subprocess.CompletedProcess(args, e.value.code or 0, got.out, got.err)


def human(n: int) -> str:
    from cpumla.cli.download import human_size

    return human_size(n)


def cells(line: str) -> list[str]:
    """A table row's words, column rules dropped."""
    return line.replace("\u2502", " ").split()


def offline(hub: Path, *args, **env) -> subprocess.CompletedProcess:
    return run_cli(*args, env=cli_env(HF_HOME=None, HF_HUB_CACHE=str(hub), **env), timeout=120)


# ---- names ----

@pytest.mark.parametrize("path,name", [
    ("Q4_K_M/DeepSeek-V3-Q4_K_M-00001-of-00009.gguf", "Q4_K_M"),
    ("DeepSeek-R1-UD-IQ1_S/DeepSeek-R1-UD-IQ1_S-00001-of-00003.gguf", "UD-IQ1_S"),
    ("deepseek-llm-7b-chat.Q4_K_M.gguf", "Q4_K_M"), ("deepseek-ai_DeepSeek-V3-Q2_K_L.gguf", "Q2_K_L"),
    ("BF16/model-00001-of-00002.gguf", "BF16"), ("tiny-q8_0.gguf", "q8_0"), ("x-IQ2_XXS.gguf", "IQ2_XXS"),
    ("x-TQ1_0.gguf", "TQ1_0"), ("gpt-MXFP4_MOE.gguf", "MXFP4_MOE"), ("model.gguf", "model"),
    ("V3-0324/DeepSeek-V3-0324-F16.gguf", "F16")])
def test_quantization_names(path, name):
    from cpumla.runtime.gguf_hub import quant_name

    assert quant_name(path) == name


def test_a_repo_files_group_into_models(repos):
    from cpumla.runtime import gguf_hub

    files = {p: len(b) for p, b in repos[REPO].items()}
    found = {q.name: q for q in gguf_hub.quants(files)}
    assert set(found) == {"Q8_0", "F16", "Q4_K_M", "UD-Q2_K_XL", "Q2_K"}     # not mmproj, not mtp-, not README
    assert found["Q4_K_M"].shards == [f"Q4_K_M/Tiny-Q4_K_M-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    assert found["Q4_K_M"].size == sum(files[s] for s in found["Q4_K_M"].shards)
    del files["Q4_K_M/Tiny-Q4_K_M-00002-of-00003.gguf"]
    q = next(q for q in gguf_hub.quants(files) if q.name == "Q4_K_M")
    assert q.missing == ["Q4_K_M/Tiny-Q4_K_M-00002-of-00003.gguf"] and len(q.present) == 2


@pytest.mark.parametrize("tag,first", [
    ("Q4_K_M", "Q4_K_M/Tiny-Q4_K_M-00001-of-00003.gguf"), ("q4_k_m", "Q4_K_M/Tiny-Q4_K_M-00001-of-00003.gguf"),
    ("Q2_K", "Tiny-Q2_K.gguf"), ("UD-Q2_K_XL", "UD-Q2_K_XL/Tiny-UD-Q2_K_XL-00001-of-00002.gguf"),
    ("Q2_K_XL", "UD-Q2_K_XL/Tiny-UD-Q2_K_XL-00001-of-00002.gguf"), ("F16", "Tiny-F16.gguf"),
    ("Tiny-Q8_0.gguf", "Tiny-Q8_0.gguf"), ("Q4_K", None), ("K_M", None), ("Q4", None)])
def test_a_tag_names_a_whole_word(repos, tag, first):
    from cpumla.runtime import gguf_hub

    hits = gguf_hub.matching(tag, gguf_hub.quants({p: len(b) for p, b in repos[REPO].items()}))
    assert [q.first for q in hits] == ([first] if first else [])


def test_a_file_name_is_fetched_literally():
    from cpumla.cli.download import _literal

    names = ["M-Q4_K_M[1].gguf", "M-Q4_K_M1.gguf", "M-Q4_K_M*.gguf", "M-Q4_K_Mx.gguf", "M-Q4_K_M?.gguf"]
    for n in ("M-Q4_K_M[1].gguf", "M-Q4_K_M*.gguf", "M-Q4_K_M?.gguf"):
        assert list(hf.utils.filter_repo_objects(names, allow_patterns=[_literal(n)])) == [n]


# ---- download ----

MTP_Q4 = "Q4_K_M/mtp-Tiny-Q4_K_M.gguf"


@pytest.mark.parametrize("tag,files", [
    ("Q8_0", ["Tiny-Q8_0.gguf"]),
    ("q4_k_m", [f"Q4_K_M/Tiny-Q4_K_M-0000{i}-of-00003.gguf" for i in (1, 2, 3)] + [MTP_Q4]),
    ("UD-Q2_K_XL", [f"UD-Q2_K_XL/Tiny-UD-Q2_K_XL-0000{i}-of-00002.gguf" for i in (1, 2)]),
    ("Q2_K", ["Tiny-Q2_K.gguf"])])
def test_download_fetches_only_that_quantization(fake, repos, capsys, tag, files):
    """That quantization's files, every shard, and the MTP file beside them where the repo has one
    (`mtp-` + the model's file name, or the folder's only one)."""
    p = cli(capsys, "download", f"{REPO}:{tag}")
    assert p.returncode == 0, p.stderr
    assert sorted(fake.fetched[0]) == sorted(files) and len(fake.fetched) == 1
    size = sum(len(repos[REPO][f]) for f in files)
    name = {"q4_k_m": "Q4_K_M"}.get(tag, tag)
    n = f"{len(files)} files" if len(files) > 1 else "1 file"
    mtp = f", its MTP layer in {MTP_Q4}" if MTP_Q4 in files else ""
    assert f"downloading {REPO}:{name} ({n}, {human(size)}{mtp}) into {fake.hub}" in p.stderr
    files = [f for f in files if f != MTP_Q4]
    size = sum(len(repos[REPO][f]) for f in files)
    first = fake.hub / f"models--{REPO.replace('/', '--')}" / "snapshots" / sha(REPO) / files[0]
    assert p.stdout.strip() == f"{REPO}:{name}: {human(size)} in {first}"
    assert f"run it with: cpumla chat {first}" in p.stderr
    assert first.read_bytes() == repos[REPO][files[0]]


def test_download_of_a_quantization_the_repo_lacks(fake, capsys):
    p = cli(capsys, "download", f"{REPO}:Q4_K")
    assert_one_line_error(p, f"{REPO}: no GGUF quantization 'Q4_K'", "Q4_K_M (", "UD-Q2_K_XL (", "Q8_0 (",
                          status=2)
    assert "mmproj" not in p.stderr and fake.fetched == []


def test_download_of_a_tag_naming_several_models(fake, capsys):
    p = cli(capsys, "download", f"{TWO}:Q4_K_M")
    assert_one_line_error(p, "'Q4_K_M' names 2 GGUF models", "a/M-Q4_K_M.gguf", "b/M-Q4_K_M.gguf", status=2)
    assert fake.fetched == []
    p = cli(capsys, "download", f"{TWO}:b/M-Q4_K_M.gguf")
    assert p.returncode == 0, p.stderr
    assert fake.fetched == [["b/M-Q4_K_M.gguf"]]


def test_download_of_an_unknown_repo(fake, capsys):
    assert_one_line_error(cli(capsys, "download", "test-org/nothing:Q4_K_M"), "test-org/nothing",
                          "no such repository", status=2)
    assert_one_line_error(cli(capsys, "download", "test-org/nothing"), "no such repository", status=2)
    assert fake.fetched == []


@pytest.mark.parametrize("ref,words", [("test-org/x:", "names no quantization"),
                                       ("not a repo:Q4_K_M", "is not a repo id")])
def test_download_of_a_malformed_ref(fake, capsys, ref, words):
    assert_one_line_error(cli(capsys, "download", ref), words, status=2)


def test_a_gguf_only_repo_without_a_tag_lists_its_quantizations(fake, repos, capsys):
    p = cli(capsys, "download", REPO)
    assert_one_line_error(p, f"{REPO} holds GGUF models only", f"cpumla download {REPO}:Q4_K_M", status=2)
    assert fake.fetched == []
    sizes = {"Q8_0": ["Tiny-Q8_0.gguf"], "F16": ["Tiny-F16.gguf"], "Q2_K": ["Tiny-Q2_K.gguf"],
             "Q4_K_M": [f"Q4_K_M/Tiny-Q4_K_M-0000{i}-of-00003.gguf" for i in (1, 2, 3)],
             "UD-Q2_K_XL": [f"UD-Q2_K_XL/Tiny-UD-Q2_K_XL-0000{i}-of-00002.gguf" for i in (1, 2)]}
    rows = {c[0]: c for c in map(cells, p.stdout.splitlines()) if c}
    for name, files in sizes.items():
        assert rows[name][1] == str(len(files))
        assert " ".join(rows[name][2:4]) == human(sum(len(repos[REPO][f]) for f in files))
        assert rows[name][4] == files[0]
    assert "mmproj" not in p.stdout


def test_a_safetensors_repo_downloads_as_before(fake, capsys):
    from cpumla.cli.download import ALLOW_PATTERNS

    p = cli(capsys, "download", ST)
    assert p.returncode == 0, p.stderr
    assert fake.fetched == [["config.json", "model.safetensors", "tokenizer.json"]]
    assert fake.patterns == [ALLOW_PATTERNS]
    assert f"run it with: cpumla chat {ST}" in p.stderr


# ---- the cache: list, offline download, info ----

@pytest.fixture
def cache(fake, repos, capsys):
    """The hub cache after downloading Q8_0, Q4_K_M and UD-Q2_K_XL from REPO and the safetensors repo,
    plus a llama GGUF repo."""
    for ref in (f"{REPO}:Q8_0", f"{REPO}:Q4_K_M", f"{REPO}:UD-Q2_K_XL", ST):
        assert cli(capsys, "download", ref).returncode == 0
    write_gguf(fake.hub / "llama.gguf", arch="llama")
    put(fake.hub, "test-org/Llama-GGUF", {"L-Q4_0.gguf": (fake.hub / "llama.gguf").read_bytes()})
    (fake.hub / "llama.gguf").unlink()
    return fake.hub


def snap_of(hub: Path, repo_id: str) -> Path:
    return hub / f"models--{repo_id.replace('/', '--')}" / "snapshots" / sha(repo_id)


def list_rows(out: str) -> dict[str, list[str]]:
    return {c[0]: c for c in map(cells, out.splitlines()) if c and ":" in c[0]}


def test_list_shows_downloaded_quantizations(cache, repos, capsys):
    p = cli(capsys, "list")
    assert p.returncode == 0, p.stderr
    assert ST in p.stdout and "deepseek_v3" in p.stdout                   # the safetensors table as before
    rows = list_rows(p.stdout)
    assert set(rows) == {f"{REPO}:Q8_0", f"{REPO}:Q4_K_M", f"{REPO}:UD-Q2_K_XL"}     # not llama, not F16
    snap = snap_of(cache, REPO)
    for name, files in (("Q8_0", ["Tiny-Q8_0.gguf"]),
                        ("Q4_K_M", [f"Q4_K_M/Tiny-Q4_K_M-0000{i}-of-00003.gguf" for i in (1, 2, 3)])):
        r = rows[f"{REPO}:{name}"]
        assert r[1] == "deepseek2" and " ".join(r[2:4]) == human(sum(len(repos[REPO][f]) for f in files))
        assert r[4] == str(len(files)) and r[5] == str(snap / files[0])
    everything = list_rows(cli(capsys, "list", "--all").stdout)
    assert everything["test-org/Llama-GGUF:Q4_0"][1] == "llama"


def test_list_marks_a_split_set_missing_a_shard(cache, capsys):
    (snap_of(cache, REPO) / "Q4_K_M/Tiny-Q4_K_M-00002-of-00003.gguf").unlink()
    r = list_rows(cli(capsys, "list").stdout)[f"{REPO}:Q4_K_M"]
    assert r[4:7] == ["2", "of", "3"]


def test_offline_download_and_info_from_the_cache(cache, capsys):
    snap = snap_of(cache, REPO)
    p = offline(cache, "download", f"{REPO}:Q4_K_M")
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().endswith(str(snap / "Q4_K_M/Tiny-Q4_K_M-00001-of-00003.gguf"))
    assert_one_line_error(offline(cache, "download", f"{REPO}:F16"), f"{REPO} in the cache",
                          "no GGUF quantization 'F16'", status=2)
    assert_one_line_error(offline(cache, "download", "test-org/absent:Q8_0"), "not in the cache",
                          "HF_HUB_OFFLINE", status=2)
    p = offline(cache, "download", REPO)            # a GGUF-only repo without a tag: what the cache has
    assert_one_line_error(p, f"{REPO} holds GGUF models only", status=2)
    assert [c[0] for c in map(cells, p.stdout.splitlines()) if c and c[0] in ("Q8_0", "Q4_K_M", "UD-Q2_K_XL",
                                                                                "F16", "Q2_K")] == \
        ["Q8_0", "UD-Q2_K_XL", "Q4_K_M"]
    # info of REPO:QUANT reads the split set from the cache: the same tensors as the whole file
    whole = json.loads(offline(cache, "info", f"{REPO}:Q8_0", "--json").stdout)
    split_ = offline(cache, "info", f"{REPO}:Q4_K_M", "--json")
    assert split_.returncode == 0, split_.stderr
    d = json.loads(split_.stdout)
    assert d["gguf"]["files"] == [str(snap / f"Q4_K_M/Tiny-Q4_K_M-0000{i}-of-00003.gguf") for i in (1, 2, 3)]
    groups = d["gguf"]["groups"]
    assert groups.pop("MTP layer")["tensors"] == 1 and d["gguf"]["mtp_file"] == str(snap / MTP_Q4)
    assert groups == whole["gguf"]["groups"] and d["weights"] == whole["weights"]
    assert d["model"] == f"{REPO}:Q4_K_M"


def test_a_missing_shard_in_the_cache_is_one_line(cache):
    (snap_of(cache, REPO) / "Q4_K_M/Tiny-Q4_K_M-00002-of-00003.gguf").unlink()
    for args in (("download", f"{REPO}:Q4_K_M"), ("info", f"{REPO}:Q4_K_M")):
        assert_one_line_error(offline(cache, *args), f"{REPO}:Q4_K_M: shard 2 of 3",
                              "Q4_K_M/Tiny-Q4_K_M-00002-of-00003.gguf", status=2)


def test_the_printed_path_of_a_cached_split_set_runs(cache):
    """The path download prints is a link in the cache: the split set is found beside it, not beside
    its blob."""
    p = offline(cache, "info", str(snap_of(cache, REPO) / "UD-Q2_K_XL/Tiny-UD-Q2_K_XL-00001-of-00002.gguf"),
                "--json")
    assert p.returncode == 0, p.stderr
    assert len(json.loads(p.stdout)["gguf"]["files"]) == 2


def test_a_cached_ref_is_a_model_everywhere(cache):
    """REPO:QUANT names a cached GGUF model wherever a model is taken: the library resolves it to the split
    set in the cache, and bench runs it; a ref not there is the one line that says how to get it."""
    from cpumla.runtime.resolve import resolve_model

    r = resolve_model(f"{REPO}:Q4_K_M")
    try:
        assert r.gguf.file.files == [snap_of(cache, REPO) / f"Q4_K_M/Tiny-Q4_K_M-0000{i}-of-00003.gguf"
                                     for i in (1, 2, 3)]
    finally:
        r.gguf.close()
    p = offline(cache, "bench", f"{REPO}:Q4_K_M", "-p", "4", "-n", "2", "-r", "1", "-o", "json")
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    tests = {t["test"] for t in (doc if isinstance(doc, list) else doc["results"])}
    assert {"pp4", "tg2"} <= tests, tests
    assert_one_line_error(offline(cache, "bench", "test-org/absent:Q8_0", "-p", "4", "-n", "2"),
                          "not in the Hugging Face cache", "cpumla download test-org/absent:Q8_0", status=2)


@pytest.mark.parametrize("args", [("bench", "-p", "4", "-n", "2", "-r", "1"), ("info",)])
def test_a_command_parses_the_file_once(cache, capsys, monkeypatch, args):
    """A command reads a GGUF's metadata once (seconds for a 129k vocabulary): the config it checks first
    and the engine it loads share the open file (chat and serve as bench: load(..., resolved=))."""
    from cpumla.checkpoint import gguf

    opened = []
    init = gguf.GGUFFile.__init__
    monkeypatch.setattr(gguf.GGUFFile, "__init__", lambda self, path: (opened.append(path), init(self, path))[1])
    p = cli(capsys, args[0], f"{REPO}:Q8_0", *args[1:])
    assert p.returncode == 0, p.stderr
    assert len(opened) == 1, opened


def test_info_of_a_ref_not_in_the_cache(cache):
    assert_one_line_error(offline(cache, "info", "test-org/absent:Q8_0"), "not in the Hugging Face cache",
                          "cpumla download test-org/absent:Q8_0", status=2)
    assert_one_line_error(offline(cache, "info", f"{REPO}:IQ1_S"), "no GGUF quantization 'IQ1_S'", "Q8_0 (",
                          status=2)
