"""Memory is counted from the config before anything is allocated, and a model that cannot fit is one
CpumlaError line naming what it needs and what is available, within a second: never an OOM kill, a
MemoryError traceback or a hang. A checkpoint's mapped weights are not counted (llama.cpp's mmap)."""

import mmap
import time

import numpy as np
import pytest

import cpumla
from cpumla.checkpoint.dummy import DummySource
from cpumla.errors import CpumlaError
from cpumla.models import config_from_dict, family
from cpumla.runtime import memory, resolve
from cpumla.runtime.resolve import preset_config

from support.cli import assert_one_line_error, cli_env, run_cli

GIB = 1 << 30
SMALL = {"num_hidden_layers": 5, "first_k_dense_replace": 2, "hidden_size": 256, "intermediate_size": 128,
         "moe_intermediate_size": 64, "n_routed_experts": 16, "num_attention_heads": 4}


@pytest.mark.parametrize("model,extra", [
    ("deepseek-ai/DeepSeek-V2-Lite", {}),
    ("deepseek-ai/DeepSeek-V3", {"moe_layer_freq": 2, "n_shared_experts": 2}),
    ("deepseek-ai/DeepSeek-V3.2", {"q_lora_rank": 64}),
    ("deepseek-ai/DeepSeek-V3.2", {"q_lora_rank": 64,
                                   "mlp_layer_types": ["dense", "sparse", "dense", "sparse", "sparse", "dense"]}),
])
@pytest.mark.parametrize("dtype", ["bf16", "fp8", "f32"])
def test_weight_bytes_are_what_dummy_weights_hold(model, extra, dtype):
    cfg = config_from_dict({**preset_config(model), **SMALL, **extra})
    fam = family(cfg.model_type)
    src = DummySource(fam.tensors(cfg), cfg.block, dtype=dtype)
    size = {"F32": 4, "BF16": 2, "F8_E4M3": 1}
    want = sum(int(np.prod(src.info(n)[1])) * size[src.info(n)[0]] for n in [*src.table, *src.scales])
    b = fam.memory_bytes(cfg, 1000, dtype)
    assert b["weights"] == want
    per_token = 4 * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + 4 * getattr(cfg, "index_head_dim", 0)
    mtp = 1 if cfg.num_nextn_predict_layers else 0          # V3's and V3.2's MTP layer
    assert b["cache"] == 1000 * per_token * (cfg.num_hidden_layers + mtp)


@pytest.mark.parametrize("dtype", ["bf16", "fp8", "f32"])
def test_v4_weight_bytes_are_what_dummy_weights_hold(dtype):
    """V4's release formats (FP8 with E8M0 scales, FP4 experts, f32 mHC, I64 hash tables) counted from
    the config, layer types grouped rather than walked."""
    cfg = config_from_dict({**preset_config("deepseek-ai/DeepSeek-V4-Flash"), "num_hidden_layers": 5,
                            "n_routed_experts": 8, "compress_ratios": [0, 4, 128, 4, 0]})
    fam = family(cfg.model_type)
    src = DummySource(fam.tensors(cfg), cfg.block, dtype=dtype)
    size = {"F32": 4, "BF16": 2, "F8_E4M3": 1, "I8": 1, "F8_E8M0": 1, "I64": 8}
    names = [*src.table, *src.scales, *src.e8m0]
    want = sum(int(np.prod(src.info(n)[1])) * size[src.info(n)[0]] for n in names)
    assert fam.memory_bytes(cfg, 1000, dtype)["weights"] == want


def _owner(a: np.ndarray):
    """the object that owns a's memory: an mmap for the huge-page arena's arrays (np.frombuffer over a
    mapping), the root array for numpy's own"""
    while isinstance(a, np.ndarray) and a.base is not None:
        a = a.base
    return a.obj if isinstance(a, memoryview) else a


@pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="no MADV_HUGEPAGE here")
def test_v4_dummy_tensors_sit_in_the_huge_page_arena():
    """V4's release-format dummies (FP4 codes, E8M0 scales, f32 mHC matrices) and every linear of 2 MiB
    or more are made in the huge-page arena, not as plain numpy arrays on 4 KiB pages; the hash
    tables (read a row a token), norms and small bf16 matrices may stay plain."""
    cfg = config_from_dict({**preset_config("deepseek-ai/DeepSeek-V4-Flash"), "num_hidden_layers": 2,
                            "n_routed_experts": 8, "compress_ratios": [4, 128], "num_hash_layers": 1})
    src = DummySource(family(cfg.model_type).tensors(cfg), cfg.block, dtype="bf16")

    def mapped(a: np.ndarray) -> bool:
        """a's memory is one of the arena's mappings (np.frombuffer over an mmap), not numpy's own"""
        return isinstance(_owner(a), mmap.mmap)

    kinds = set()
    for name in [*src.table, *src.e8m0]:
        kind, shape = src.info(name)
        big = int(np.prod(shape)) * {"BF16": 2, "F32": 4}.get(kind, 1) >= 2 << 20
        f32_matrix = name in src.table and src.table[name][1] == "f32"
        if kind in ("I8", "F8_E8M0") or f32_matrix or (big and kind in ("BF16", "F8_E4M3")):
            assert mapped(src.tensor(name)), name
            kinds.add(kind)
    assert not mapped(np.empty(1 << 22, np.uint8))
    assert {"I8", "F8_E8M0", "F32", "F8_E4M3", "BF16"} <= kinds


@pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="no MADV_HUGEPAGE here")
def test_small_arena_tensors_never_share_a_block_with_large_ones():
    """A norm or scale grid made before a weight that is quantized and dropped must not keep that
    weight's block resident: small tensors (under 2 MiB) are packed in blocks of their own."""
    from cpumla.checkpoint.arena import HUGE as TWO_MIB
    from cpumla.checkpoint.arena import HugeArena

    arena = HugeArena()
    norm = arena.empty((4096,), np.float32, small=True)
    weight = arena.empty((TWO_MIB + 4096,), np.uint8)
    scale = arena.empty((64, 32), np.uint8, small=True)
    assert isinstance(_owner(norm), mmap.mmap) and isinstance(_owner(weight), mmap.mmap)
    assert _owner(norm) is _owner(scale)
    assert _owner(norm) is not _owner(weight)


HUGE = [
    ("deepseek-ai/DeepSeek-V4-Flash", {}, None),
    ("deepseek-ai/DeepSeek-V4-Pro", {}, None),
    ("deepseek-ai/DeepSeek-V3", {}, None),
    ("deepseek-ai/DeepSeek-V2-Lite", {}, None),
    ("deepseek-ai/DeepSeek-V2-Lite", {"hidden_size": 65536}, None),
    ("deepseek-ai/DeepSeek-V2-Lite", {"num_hidden_layers": 2, "n_shared_experts": 10**6}, None),
    ("deepseek-ai/DeepSeek-V2-Lite", {"num_hidden_layers": 1, "n_routed_experts": 10**7}, None),
    ("deepseek-ai/DeepSeek-V2-Lite", {"num_hidden_layers": 10**6}, None),
    ("deepseek-ai/DeepSeek-V2-Lite", {"num_hidden_layers": 1, "n_routed_experts": 4}, 10**12),
    ("deepseek-ai/DeepSeek-V3.2", {"num_hidden_layers": 1, "n_routed_experts": 4}, 10**9),
]


@pytest.mark.parametrize("model,overrides,ctx", HUGE, ids=lambda v: str(v)[:50])
def test_models_that_cannot_fit_are_refused_at_once(monkeypatch, model, overrides, ctx):
    monkeypatch.setenv("CPUMLA_MEMORY_AVAILABLE", str(8 * GIB))
    t0 = time.perf_counter()
    with pytest.raises(CpumlaError, match=r"needs .* GiB|needs .* bytes") as e:
        cpumla.load(model, dummy_weights=True, hf_overrides=overrides, max_seq_len=ctx)
    assert time.perf_counter() - t0 < 1.0
    assert "8.0 GiB is available" in str(e.value) and "\n" not in str(e.value)


def test_the_limit_is_the_available_memory(monkeypatch):
    """A small model loads under a limit above its count and is refused under one below it."""
    ov = {"num_hidden_layers": 1, "n_routed_experts": 4, "hidden_size": 128, "num_attention_heads": 2}
    cfg, _ = resolve.load_config("deepseek-ai/DeepSeek-V2-Lite", ov)
    b = family(cfg.model_type).memory_bytes(cfg, 64, "bf16")
    total = sum(b.values())
    monkeypatch.setenv("CPUMLA_MEMORY_AVAILABLE", str(total))
    cpumla.load("deepseek-ai/DeepSeek-V2-Lite", dummy_weights=True, hf_overrides=ov, max_seq_len=64)
    monkeypatch.setenv("CPUMLA_MEMORY_AVAILABLE", str(total - 1))
    with pytest.raises(CpumlaError, match="available"):
        cpumla.load("deepseek-ai/DeepSeek-V2-Lite", dummy_weights=True, hf_overrides=ov, max_seq_len=64)


def test_mapped_checkpoint_weights_are_not_counted(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    from support import models

    d = tmp_path / "m"
    models.build("v2-lite", d)
    cfg, _ = resolve.load_config(str(d))
    b = family(cfg.model_type).memory_bytes(cfg, 32, "bf16")
    monkeypatch.setenv("CPUMLA_MEMORY_AVAILABLE", str(b["cache"] + b["scratch"]))   # less than the weights
    assert (d / "model.safetensors").stat().st_size > b["cache"] + b["scratch"] - b["weights"]
    eng = cpumla.load(str(d), max_seq_len=32)
    assert np.isfinite(eng.forward([1, 2, 3])).all()
    monkeypatch.setenv("CPUMLA_MEMORY_AVAILABLE", str(b["cache"] + b["scratch"] - 1))
    with pytest.raises(CpumlaError, match="caches"):
        cpumla.load(str(d), max_seq_len=32)


def test_full_logits_beyond_memory_are_refused(monkeypatch):
    eng = cpumla.load("deepseek-ai/DeepSeek-V2-Lite", dummy_weights=True, max_seq_len=4096,
                      hf_overrides={"num_hidden_layers": 1, "n_routed_experts": 4, "hidden_size": 64,
                                    "num_attention_heads": 2, "intermediate_size": 64, "moe_intermediate_size": 32})
    monkeypatch.setenv("CPUMLA_MEMORY_AVAILABLE", str(GIB))
    with pytest.raises(CpumlaError, match="logits of 3000 tokens"):
        eng.forward(np.ones(3000, np.int64))        # 3000 x 102400 x 4 bytes
    assert eng.pos == 0
    assert eng.forward(np.ones(3000, np.int64), last_only=True).shape == (1, 102400)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "8"])
def test_bad_max_seq_len_is_an_error(bad):
    with pytest.raises(CpumlaError, match="max_seq_len"):
        cpumla.load("deepseek-ai/DeepSeek-V2-Lite", dummy_weights=True, max_seq_len=bad,
                    hf_overrides={"num_hidden_layers": 1, "n_routed_experts": 4})


def _tree(root, files):
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)


def test_cgroup_limits_v1_and_v2(tmp_path):
    v2 = tmp_path / "v2"
    _tree(v2, {"proc": "0::/a/b\n", "fs/cgroup.controllers": "memory\n",
               "fs/a/memory.max": str(10 * GIB), "fs/a/memory.current": str(4 * GIB),
               "fs/a/memory.stat": f"anon 1\ninactive_file {GIB}\n",
               "fs/a/b/memory.max": "max\n", "fs/a/b/memory.current": "5\n"})
    room, where = memory.cgroup_room(v2 / "proc", v2 / "fs")
    assert room == 7 * GIB and where == v2 / "fs" / "a"
    v1 = tmp_path / "v1"
    _tree(v1, {"proc": "4:memory:/x\n1:cpu:/\n", "fs/memory/x/memory.limit_in_bytes": str(3 * GIB),
               "fs/memory/x/memory.usage_in_bytes": str(GIB), "fs/memory/memory.limit_in_bytes": str(2**63 - 4096)})
    assert memory.cgroup_room(v1 / "proc", v1 / "fs")[0] == 2 * GIB
    assert memory.cgroup_room(tmp_path / "missing", tmp_path) is None


@pytest.mark.parametrize("args", [
    ["smoke", "--dummy-weights", "-m", "deepseek-ai/DeepSeek-V3"],
    ["smoke", "--dummy-weights", "-m", "deepseek-ai/DeepSeek-V2-Lite", "-p", "100000000"],
    ["bench", "--kernels", "--rows", "1000000000"],
    ["bench", "--kernels", "--stream-mb", "10000000"],
    ["bench", "--kernels", "-t", "300"],
    ["bench", "deepseek-ai/DeepSeek-V2-Lite", "--dummy-weights", "-t", "300"],
])
def test_cli_refuses_in_one_line(args):
    assert_one_line_error(run_cli(*args, env=cli_env(CPUMLA_MEMORY_AVAILABLE=str(8 * GIB)), timeout=60), status=2)


def test_set_threads_refuses_beyond_the_pool():
    from cpumla import native

    with pytest.raises(CpumlaError, match="threads"):
        native.set_threads(native.MAX_THREADS + 1)
    try:
        assert native.set_threads(native.MAX_THREADS) == native.MAX_THREADS    # the pool really has that many
    finally:
        native.set_threads(None)
