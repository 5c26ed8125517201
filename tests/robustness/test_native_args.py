"""Every public kernel wrapper in cpumla.native checks its arguments: a wrong size, dtype, stride or
a read-only output is one CpumlaError line, never a heap overflow in the C kernel or a silent write
of float32 bytes into another dtype."""

import numpy as np
import pytest

from cpumla import native
from cpumla.errors import CpumlaError

F = np.float32


def w32(rows, cols):
    return native.Weight(np.ones((rows, cols), F), "f32")


BAD_CALLS = {
    "gemv out too small": lambda: native.gemv(w32(64, 8), np.ones(8, F), out=np.empty(4, F)),
    "gemv out float64": lambda: native.gemv(w32(4, 8), np.ones(8, F), out=np.empty(4, np.float64)),
    "gemv out read-only": lambda: native.gemv(w32(4, 8), np.ones(8, F), out=np.broadcast_to(np.empty(1, F), (4,))),
    "gemv x wrong length": lambda: native.gemv(w32(4, 8), np.ones(5, F)),
    "gemv x not an array": lambda: native.gemv(w32(4, 8), [1.0] * 8),
    "gemv w not a Weight": lambda: native.gemv(np.ones((4, 8), F), np.ones(8, F)),
    "gemm out too small": lambda: native.gemm(w32(64, 8), np.ones((3, 8), F), out=np.empty((3, 4), F)),
    "gemm out too few rows": lambda: native.gemm(w32(4, 8), np.ones((30, 8), F), out=np.empty((1, 4), F)),
    "gemm x 1-D": lambda: native.gemm(w32(4, 8), np.ones(8, F)),
    "head_gemv row0 past the rows": lambda: native.head_gemv(w32(8, 4), 100, 2, 2, np.ones((1, 2, 4), F)),
    "head_gemv heads past the rows": lambda: native.head_gemv(w32(8, 4), 0, 4, 4, np.ones((1, 3, 4), F)),
    "head_gemv negative row0": lambda: native.head_gemv(w32(8, 4), -4, 2, 2, np.ones((1, 2, 4), F)),
    "head_gemv x cols": lambda: native.head_gemv(w32(8, 4), 0, 2, 2, np.ones((1, 2, 3), F)),
    "head_gemv out too small": lambda: native.head_gemv(w32(8, 4), 0, 2, 2, np.ones((1, 2, 4), F),
                                                        out=np.empty((1, 1, 2), F)),
    "head_gemv_t x rows": lambda: native.head_gemv_t(w32(8, 4), 0, 2, 2, np.ones((1, 2, 4), F)),
    "head_gemv_t huge row0": lambda: native.head_gemv_t(w32(8, 4), 2**70, 2, 2, np.ones((1, 2, 2), F)),
    "head_gemv_t float row0": lambda: native.head_gemv_t(w32(8, 4), 1.5, 2, 2, np.ones((1, 2, 2), F)),
    "rope dim above the head": lambda: native.rope(np.ones((1, 2, 8), F), np.zeros(1, np.int64),
                                                   np.ones(32, F), 0, 64),
    "rope offset past the head": lambda: native.rope(np.ones((1, 2, 8), F), np.zeros(1, np.int64),
                                                     np.ones(4, F), 4, 8),
    "rope odd dim": lambda: native.rope(np.ones((1, 2, 8), F), np.zeros(1, np.int64), np.ones(4, F), 0, 7),
    "rope short inv_freq": lambda: native.rope(np.ones((1, 2, 64), F), np.zeros(1, np.int64),
                                               np.ones(2, F), 0, 64),
    "rope short pos": lambda: native.rope(np.ones((50, 2, 8), F), np.zeros(1, np.int64), np.ones(4, F), 0, 8),
    "rope read-only x": lambda: native.rope(np.broadcast_to(np.ones(8, F), (1, 2, 8)), np.zeros(1, np.int64),
                                            np.ones(4, F), 0, 8),
    "rope float pos": lambda: native.rope(np.ones((1, 2, 8), F), np.zeros(1, F), np.ones(4, F), 0, 8),
    "attention dk above the kv width": lambda: native.mla_attention(np.ones((1, 2, 64), F), np.ones((4, 8), F),
                                                                    64, 8, 1.0),
    "attention dv above the kv width": lambda: native.mla_attention(np.ones((1, 2, 8), F), np.ones((4, 8), F),
                                                                    8, 64, 1.0),
    "attention dk above the q width": lambda: native.mla_attention(np.ones((1, 2, 4), F), np.ones((4, 8), F),
                                                                   8, 8, 1.0),
    "attention kv_idx narrower than n_kv": lambda: native.mla_attention(
        np.ones((1, 2, 8), F), np.ones((400, 8), F), 8, 8, 1.0, kv_idx=np.zeros((1, 2), np.int32),
        kv_len=np.array([400])),
    "attention kv_idx rows": lambda: native.mla_attention(np.ones((3, 2, 8), F), np.ones((4, 8), F), 8, 8, 1.0,
                                                          kv_idx=np.zeros((1, 2), np.int32)),
    "attention short kv_len": lambda: native.mla_attention(np.ones((3, 2, 8), F), np.ones((4, 8), F), 8, 8, 1.0,
                                                           kv_len=np.array([1])),
    "attention short sinks": lambda: native.mla_attention(np.ones((1, 4, 8), F), np.ones((4, 8), F), 8, 8, 1.0,
                                                          sinks=np.zeros(1, F)),
    "attention kv float64": lambda: native.mla_attention(np.ones((1, 2, 8), F), np.ones((4, 8)), 8, 8, 1.0),
    "router more experts than logits": lambda: native.Router("softmax", 64, 2)(np.ones((1, 4), F)),
    "router short bias": lambda: native.Router("noaux_tc", 8, 2, bias=np.zeros(2, F)),
    "router short token ids": lambda: native.Router("softmax", 4, 2)(np.ones((3, 4), F), np.zeros(1, np.int64)),
    "router tid2eid narrower than top_k": lambda: native.Router("hash", 4, 3, tid2eid=np.zeros((10, 1), np.int64)),
    "router experts beyond int32": lambda: native.Router("softmax", 2**40, 2),
    "cache_store source wider than the cache": lambda: native.cache_store(np.zeros((4, 8), F), np.ones((1, 64), F),
                                                                          np.array([0])),
    "cache_store short slots": lambda: native.cache_store(np.zeros((4, 8), F), np.ones((3, 8), F), np.array([0])),
    "cache_store read-only cache": lambda: native.cache_store(np.broadcast_to(np.zeros(8, F), (4, 8)),
                                                              np.ones((1, 8), F), np.array([0])),
    "cache_store float slots": lambda: native.cache_store(np.zeros((4, 8), F), np.ones((1, 8), F), np.array([0.5])),
    "rmsnorm short weight": lambda: native.rmsnorm(np.ones((2, 64), F), np.ones(4, F), 1e-6),
    "rmsnorm out too small": lambda: native.rmsnorm(np.ones((20, 64), F), None, 1e-6, out=np.empty((1, 64), F)),
    "rmsnorm out float64": lambda: native.rmsnorm(np.ones((2, 4), F), None, 1e-6, out=np.empty((2, 4))),
    "swiglu out too small": lambda: native.swiglu(np.ones((8, 64), F), np.ones((8, 64), F), out=np.empty((1, 4), F)),
    "swiglu float64 gate": lambda: native.swiglu(np.ones((2, 4)), np.ones((2, 4))),
    "swiglu up smaller": lambda: native.swiglu(np.ones((8, 64), F), np.ones((1, 64), F)),
    "softmax read-only": lambda: native.softmax(np.broadcast_to(np.ones(4, F), (2, 4))),
    "softmax 1-D": lambda: native.softmax(np.ones(4, F)),
    "topk negative k": lambda: native.topk(np.ones(4, F), -1),
    "topk float64": lambda: native.topk(np.ones(4), 2),
    "experts x width": lambda: native.Experts([(w32(4, 8), w32(4, 8), w32(8, 4))])(
        np.ones((1, 3), F), np.zeros((1, 1), np.int32), np.ones((1, 1), F), np.zeros((1, 8), F)),
    "experts out too small": lambda: native.Experts([(w32(4, 8), w32(4, 8), w32(8, 4))])(
        np.ones((5, 8), F), np.zeros((5, 1), np.int32), np.ones((5, 1), F), np.zeros((1, 8), F)),
    "experts short w": lambda: native.Experts([(w32(4, 8), w32(4, 8), w32(8, 4))])(
        np.ones((1, 8), F), np.zeros((1, 3), np.int32), np.ones((1, 1), F), np.zeros((1, 8), F)),
    "weight negative row stride": lambda: native.Weight(np.ones((4, 8), F)[::-1], "f32"),
    "weight scale grid float64": lambda: native.Weight(np.ones((4, 8), np.uint8), "e4m3", np.ones((1, 1))),
    "weight bad block": lambda: native.Weight(np.ones((4, 8), np.uint8), "e4m3", np.ones((1, 1), F), (0, 0)),
    "weight bool data": lambda: native.Weight(np.ones((4, 8), bool), "e4m3", np.ones((1, 1), F)),
    "read_probe strided": lambda: native.read_probe(np.zeros(1024, np.uint8)[::2]),
}


@pytest.mark.parametrize("name", BAD_CALLS)
def test_bad_kernel_arguments_are_one_line_errors(name):
    native.ensure_init()
    with pytest.raises(CpumlaError) as e:
        BAD_CALLS[name]()
    assert "\n" not in str(e.value) and str(e.value)


def test_checked_calls_still_compute():
    """The checks accept what the kernels take: strided rows, int32 indices, float64 small vectors."""
    rng = np.random.default_rng(0)
    big = rng.standard_normal((6, 16)).astype(F)
    w = native.Weight(big[:, :8], "f32")
    x = rng.standard_normal(8).astype(F)
    out = np.empty(6, F)
    assert native.gemv(w, x, out=out) is out
    np.testing.assert_allclose(out, big[:, :8] @ x, rtol=1e-5, atol=1e-5)
    xs = rng.standard_normal((3, 12)).astype(F)[:, :8]
    np.testing.assert_allclose(native.gemm(w, xs), xs @ big[:, :8].T, rtol=1e-5, atol=1e-5)
    kv = rng.standard_normal((5, 8)).astype(F)
    q = rng.standard_normal((1, 2, 8)).astype(F)
    o = native.mla_attention(q, kv, 8, 8, 0.5, kv_idx=np.array([[0, 4, -1]], np.int64))
    s = 0.5 * q[0] @ kv[[0, 4]].T
    p = np.exp(s - s.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    np.testing.assert_allclose(o[0], p @ kv[[0, 4]], rtol=1e-5, atol=1e-5)


def test_read_probe_of_a_misaligned_buffer_reads_an_aligned_copy():
    buf = np.zeros(1 << 12, np.float64)[1:]
    buf[:] = np.arange(buf.size)
    assert native.read_probe(buf[: (buf.size // 8) * 8]) == float(buf[: (buf.size // 8) * 8].sum())
