"""What tensor-parallel ranks are made of: a weight's rows or columns as a view (Weight.part) computing
what the same rows and columns of the whole weight compute, in every format, and refused with one line
where the slice would cut a block; the shared-memory communicator (native/comm.py ShmComm) between
threads standing in for ranks: sums with the same bits on every rank, gathers and broadcasts larger
than a slot, and a rank that fails or stays away named within the time limit."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
import torch

from cpumla import native
from cpumla.errors import CpumlaError
from cpumla.native.comm import SLOT_BYTES, ShmComm


def e4m3(a: np.ndarray, block):
    """a in FP8 e4m3 with a float32 scale per block (block rows x block cols)."""
    r, c = a.shape
    br, bc = block
    scale = np.zeros((-(-r // br), -(-c // bc)), np.float32)
    q = np.zeros((r, c), np.float32)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            blk = a[i * br:(i + 1) * br, j * bc:(j + 1) * bc]
            scale[i, j] = max(np.abs(blk).max(), 1e-12) / 448.0
            q[i * br:(i + 1) * br, j * bc:(j + 1) * bc] = blk / scale[i, j]
    codes = torch.from_numpy(q).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    return native.Weight(codes, "e4m3", scale=scale, block=tuple(block))


def weight(fmt: str, rows: int, cols: int, seed: int = 0) -> native.Weight:
    a = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    if fmt == "f32":
        return native.Weight(a, "f32")
    if fmt == "bf16":
        return native.Weight((a.view(np.uint32) >> 16).astype(np.uint16), "bf16")
    if fmt == "e4m3-16":
        return e4m3(a, (16, 16))
    if fmt == "e4m3":
        return e4m3(a, (128, 128))
    if fmt == "q8_0":
        gguf = pytest.importorskip("gguf")
        return native.Weight(gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0).copy(), "q8_0")
    return native.quantize(native.Weight(a, "f32"), fmt)


@pytest.mark.parametrize("fmt", ["f32", "bf16", "e4m3-16", "e4m3", "q8", "q4", "q8_0"])
def test_a_part_computes_what_its_rows_and_columns_of_the_whole_do(fmt):
    rows, cols = 256, 512
    w = weight(fmt, rows, cols)
    full = native.dequant(w)
    unit = 128 if fmt == "e4m3" else 32
    x = np.random.default_rng(1).standard_normal(cols).astype(np.float32)
    for axis, a, b in [(0, 0, 128), (0, 128, 256), (1, 0, 256), (1, 256, 512), (1, unit, 3 * unit)]:
        p = w.part(axis, a, b, "t")
        want = full[a:b] if axis == 0 else full[:, a:b]
        np.testing.assert_array_equal(native.dequant(p), want)
        # the whole weight's products: its rows a..b, or its product with x zero outside columns a..b
        # (activations are rounded per element or per 32-block, so the blocks kept round alike)
        if axis == 0:
            np.testing.assert_array_equal(native.gemv(p, x), native.gemv(w, x)[a:b])
        else:
            masked = np.zeros_like(x)
            masked[a:b] = x[a:b]
            ref = native.gemv(w, masked)
            np.testing.assert_allclose(native.gemv(p, x[a:b]), ref, rtol=0, atol=1e-5 * np.abs(ref).max())
        assert p.nbytes < w.nbytes
        # rows stay a view of the weight; columns are a contiguous copy of their own, 64-byte aligned
        assert np.shares_memory(p.data, w.data) == (axis == 0)
        if axis == 1:
            assert p.data.flags.c_contiguous and p.data.ctypes.data % 64 == 0


@pytest.mark.parametrize("fmt, axis, a, b, what", [
    ("e4m3", 0, 0, 64, "rows 0..64 of 256 cut through its 128x128 e4m3 blocks"),
    ("e4m3", 1, 128, 192, "columns 128..192 of 512 cut through its 128x128 e4m3 blocks"),
    ("q4", 1, 16, 48, "columns 16..48 of 512 cut through its 1x32 q4 blocks"),
    ("q8_0", 1, 0, 40, "columns 0..40 of 512 cut through its 32-wide q8_0 blocks"),
    ("f32", 1, 0, 600, "no columns 0..600 in 256x512"),
])
def test_a_part_that_cuts_a_block_is_refused_naming_the_tensor(fmt, axis, a, b, what):
    w = weight(fmt, 256, 512)
    with pytest.raises(CpumlaError) as e:
        w.part(axis, a, b, "model.layers.3.mlp.down_proj.weight")
    assert str(e.value) == f"model.layers.3.mlp.down_proj.weight: {what}"


# ---- the shared-memory communicator ----------------------------------------------------------------
def ranks(world: int, timeout: float = 30.0):
    path = ShmComm.create(world)
    try:
        return [ShmComm(path, r, world, timeout) for r in range(world)]
    finally:
        os.unlink(path)


def together(comms, fn):
    """fn(comm) on a thread per rank; their results (an exception is a result)."""
    out = [None] * len(comms)

    def run(i):
        try:
            out[i] = fn(comms[i])
        except Exception as e:   # noqa: BLE001
            out[i] = e
    ts = [threading.Thread(target=run, args=(i,)) for i in range(len(comms))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    return out


@pytest.mark.parametrize("world", [2, 3, 4])
def test_all_reduce_sums_in_rank_order_on_every_rank(world):
    comms = ranks(world)
    rng = np.random.default_rng(world)
    n = SLOT_BYTES // 4 * 2 + 1001                 # three pieces
    parts = [rng.standard_normal(n).astype(np.float32) for _ in range(world)]
    want = parts[0].copy()
    for p in parts[1:]:
        want += p
    for _ in range(3):                           # slot sets reused
        bufs = [p.copy() for p in parts]
        together(comms, lambda c: c.all_reduce(bufs[c.rank]))
        for b in bufs:
            np.testing.assert_array_equal(b, want)
    st = comms[0].stats()
    assert st["all_reduces"] == 3 and st["seconds"] > 0


def test_gather_brings_each_ranks_columns_to_rank_0_and_broadcast_rank_0s_bytes():
    comms = ranks(3)
    rows, ld = 40, 70000                          # rows of 3 slices do not fit one slot: pieces
    cut = [0, 23000, 46000, ld]
    full = np.random.default_rng(0).standard_normal((rows, ld)).astype(np.float32)
    bufs = []
    for r in range(3):
        b = np.full((rows, ld), -1.0, np.float32)
        b[:, cut[r]:cut[r + 1]] = full[:, cut[r]:cut[r + 1]]
        bufs.append(b)
    res = together(comms, lambda c: c.gather(bufs[c.rank], cut[c.rank], cut[c.rank + 1] - cut[c.rank]))
    assert res == [None, None, None]
    np.testing.assert_array_equal(bufs[0], full)
    assert (bufs[1][:, :cut[1]] == -1).all()          # the others keep their own
    msgs = [np.arange(3 * SLOT_BYTES // 8, dtype=np.int64) if r == 0 else np.zeros(3 * SLOT_BYTES // 8, np.int64)
            for r in range(3)]
    together(comms, lambda c: c.broadcast(msgs[c.rank], command=True))
    for m in msgs:
        np.testing.assert_array_equal(m, msgs[0])


def test_a_failed_rank_ends_the_others_wait_naming_it():
    comms = ranks(3)
    comms[2].fail()
    res = together(comms[:2], lambda c: c.all_reduce(np.ones(8, np.float32)))
    for r in res:
        assert isinstance(r, CpumlaError) and str(r) == f"tensor-parallel rank 2 (pid {os.getpid()}) stopped"
    with pytest.raises(CpumlaError, match="rank 2 .* stopped"):       # and every later exchange
        comms[0].broadcast(np.zeros(4, np.int64))


def test_a_rank_that_stays_away_is_named_after_the_time_limit():
    comms = ranks(2, timeout=0.3)
    t = time.perf_counter()
    with pytest.raises(CpumlaError) as e:
        comms[0].all_reduce(np.ones(8, np.float32))
    assert str(e.value) == f"tensor-parallel rank 1 (pid {os.getpid()}) did not answer within 0.3 s"
    assert time.perf_counter() - t < 5
    # rank 1, told of rank 0's failure, names the same cause
    with pytest.raises(CpumlaError, match="rank 1 .* did not answer within 0.3 s"):
        comms[1].all_reduce(np.ones(8, np.float32))
