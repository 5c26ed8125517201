"""Routed experts read from disk (runtime/streaming.py, native/stream.py, expert_stream.c): with slots for a
quarter of the experts, every family and checkpoint format gives the logits of the model in memory, bit
for bit, prefill and decode, on one and two threads; the budget decides when experts stream; a file cut
short under a running model is a one-line error."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

import cpumla
from cpumla.cli.quantize import quantize_checkpoint
from cpumla.errors import CpumlaError
from cpumla.models import family
from cpumla.native.stream import disk_probe
from cpumla.runtime import streaming

from support import gguf_files, models
from support.cli import assert_one_line_error, cli_env, run_cli
from support.models import IDS


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """name -> a checkpoint of each family and stored format, made once."""
    root = tmp_path_factory.mktemp("streamed")
    out = {}
    for v in ("v2-lite", "v3"):
        m = models.build(v, root / v)
        out[v] = root / v
        if v == "v3":
            models.quantize_fp8(root / v, root / "v3-fp8")
            out["v3-fp8"] = root / "v3-fp8"
            quantize_checkpoint(str(root / v), root / "v3-q4", "q4")
            out["v3-q4"] = root / "v3-q4"
            gguf_files.write(m, root / "v3-q8_0.gguf", "Q8_0")
            out["v3-gguf"] = root / "v3-q8_0.gguf"
    models.build_v32(root / "v32")
    out["v32"] = root / "v32"
    models.build_v4(root / "v4")
    out["v4"] = root / "v4"
    models.build_v4(root / "v4-f32", num_hash_layers=1)
    models.quantize_v4(root / "v4-f32", root / "v4-fp4", {"expert_dtype": "fp4"})
    out["v4-fp4"] = root / "v4-fp4"
    return out


def run(path, threads, **kw):
    """Prefill of IDS, then three decode steps: their logits, and the engine's stream statistics."""
    eng = cpumla.load(str(path), threads=threads, **kw)
    try:
        got = [eng.forward(IDS)] + [eng.forward([t]) for t in (9, 4, 120)]
        stats = eng.stream.stats() if eng.stream is not None else None
    finally:
        eng.close()
    return got, stats


def routed_count(path) -> int:
    eng = cpumla.load(str(path))
    try:
        return sum(t.n for t in eng.model.routed_tables())
    finally:
        eng.close()


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("name", ["v2-lite", "v3", "v3-fp8", "v3-q4", "v3-gguf", "v32", "v4", "v4-fp4"])
def test_a_quarter_of_the_experts_gives_the_same_bits(ckpts, name, threads):
    path = ckpts[name]
    want, none = run(path, threads)
    assert none is None                                     # everything fits: mapped, as ever
    slots = routed_count(path) // 4
    got, st = run(path, threads, expert_slots=slots)
    for a, b in zip(want, got):
        assert np.array_equal(a, b)
    assert st.slots == slots and st.reads > 0 and st.bytes_read > 0 and st.hits < st.lookups
    assert st.prefetches > 0                                # decode reads the next layer's experts ahead


def test_both_policies_give_the_same_bits(ckpts):
    want, _ = run(ckpts["v3"], 2)
    got, st = run(ckpts["v3"], 2, expert_slots=5, expert_policy="lfu")
    for a, b in zip(want, got):
        assert np.array_equal(a, b)
    assert st.reads > 0
    with pytest.raises(CpumlaError, match="policy"):
        cpumla.load(str(ckpts["v3"]), expert_slots=5, expert_policy="fifo")


def test_slots_for_every_expert_hit_after_the_first_read(ckpts):
    n = routed_count(ckpts["v3"])
    eng = cpumla.load(str(ckpts["v3"]), expert_slots=n)
    try:
        eng.forward(IDS)
        first = eng.stream.stats()
        eng.stream.reset_stats()
        for t in (9, 4, 120):
            eng.forward([t])
        st = eng.stream.stats()
    finally:
        eng.close()
    assert first.reads == first.lookups - first.hits and first.reads <= n
    assert st.lookups > 0 and st.hits == st.lookups and st.reads == 0 and st.bytes_read == 0


def test_the_budget_decides(ckpts):
    path = ckpts["v3"]
    eng = cpumla.load(str(path), expert_slots=4)
    per = eng.stream.stats().slot_bytes
    cfg, src = eng.config, eng._src
    b = streaming.budget(family(cfg.model_type), cfg, src, eng.max_seq_len, 1 << 40)
    eng.close()
    assert b.fits and b.routed > 0 and b.resident > 0
    base = streaming.MARGIN + b.resident + b.cache + b.scratch
    # the whole model fits: mapped
    eng = cpumla.load(str(path), memory=base + b.routed)
    assert eng.stream is None
    eng.close()
    # room for 4 experts: 4 slots
    eng = cpumla.load(str(path), memory=base + 4 * per + per // 2)
    assert eng.stream is not None and eng.stream.stats().slots == 4
    eng.close()
    # fewer than the 3 a token uses: refused in one line
    with pytest.raises(CpumlaError, match="fewer than the 3 a token uses") as e:
        cpumla.load(str(path), memory=base + 2 * per)
    assert "\n" not in str(e.value)
    with pytest.raises(CpumlaError, match="memory must be"):
        cpumla.load(str(path), memory=-5)


def test_streamed_layers_keep_the_rest_in_memory(ckpts):
    """The resident part is copied out of the mapping; the routed experts stay in it, untouched."""
    eng = cpumla.load(str(ckpts["v3"]), expert_slots=4)
    try:
        ck = eng._src
        lo, size, _ = ck.mappings()[0]
        inside = lambda a: lo <= a.ctypes.data < lo + size          # noqa: E731
        L = eng.model.layers[1]
        assert not inside(L.kv_a.data) and not inside(L.gate.data) and not inside(eng.model.lm_head.data)
        assert inside(L.experts._keep[0][0].data)
    finally:
        eng.close()


def test_a_file_cut_short_is_one_line(ckpts, tmp_path):
    d = tmp_path / "v3"
    shutil.copytree(ckpts["v3"], d)
    eng = cpumla.load(str(d), expert_slots=3)
    eng.forward(IDS[:4])
    f = d / "model.safetensors"
    os.truncate(f, os.path.getsize(f) // 3)
    eng.reset()
    with pytest.raises(CpumlaError) as e:
        eng.forward(IDS)
    msg = str(e.value)
    assert "\n" not in msg and str(f) in msg and "cut short" in msg
    # decode, whose reads ahead fail too: a call fails in one line, or gives the logits of the model in
    # memory (never a result computed on what did not read)
    ref = cpumla.load(str(ckpts["v3"]))
    eng.reset()
    failed = 0
    for t in IDS * 2:
        try:
            got = eng.forward([t])
        except CpumlaError as err:
            assert "cut short" in str(err) and "\n" not in str(err)
            failed += 1
            continue
        assert np.array_equal(got, ref.forward([t]))
    assert failed > 0
    eng.close()
    ref.close()


def test_cli_memory(ckpts, tmp_path):
    p = run_cli("chat", str(ckpts["v3"]), "--tokenizer", "bundled", "-p", "hi", "-n", "2", "--memory", "lots")
    assert_one_line_error(p, "--memory")
    p = run_cli("chat", str(ckpts["v3"]), "--tokenizer", "bundled", "-p", "hi", "-n", "2", "--memory", "100M")
    assert_one_line_error(p, "a token uses")


def test_disk_probe(tmp_path):
    f = tmp_path / "blob"
    f.write_bytes(os.urandom(3 << 20))
    rate, got = disk_probe(f, 2 << 20, threads=4)
    assert got == 2 << 20 and rate > 0
    with pytest.raises(CpumlaError, match="cannot open"):
        disk_probe(tmp_path / "missing", 1 << 20)


def test_bench_reports_the_disk(ckpts):
    from cpumla.bench import model as mb

    eng = cpumla.load(str(ckpts["v3"]), expert_slots=4, max_seq_len=64)
    try:
        probe = mb.BandwidthProbe(eng.model.probe_arrays())
        rs = list(mb.run(eng, model_name="v3", n_prompt=8, n_gen=4, reps=1, threads=[1], depths=[0], load_s=0.0,
                         probe=probe, peak_gflops={1: 1.0}))
    finally:
        eng.close()
    for r in rs:
        d = mb.as_dict(r)
        assert 0.0 <= d["expert_hit_rate"] < 1.0 and d["disk_bytes_per_token"] > 0
        assert d["disk_read_gbps"] > 0 and d["disk_probe_gbps"] > 0


def test_info_says_what_streaming_gives(ckpts):
    """With less memory than the model: the routed experts' bytes, a token's share, and what a token would
    read from disk with the disk probe of this machine."""
    p = run_cli("info", str(ckpts["v3"]), "--json", env=cli_env(CPUMLA_MEMORY_AVAILABLE=str(1 << 20)))
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    s = d["streamed"]
    assert d["routed"] > 0 and d["routed_per_token"] == d["routed"] * 3 // 8
    assert s["held"] == 0.0 and s["disk_bytes_per_token"] == d["routed_per_token"] and s["disk_probe_gbps"] > 0
    p = run_cli("info", str(ckpts["v3"]))
    assert p.returncode == 0 and "from disk" not in p.stdout            # it fits: nothing to say
