"""numpy-friendly wrappers of each kernel (cpumla.h, mla_attention.h), for tests, benchmarks and load-time work: every
argument checked, a CpumlaError for anything the library would refuse. The runtime's per-token path
calls the library directly with preallocated buffers (the model's native state)."""

from __future__ import annotations

import numpy as np

from cpumla.errors import CpumlaError
from cpumla.native import checks
from cpumla.native.checks import ld
from cpumla.native.library import QBLOCK, QUANT_FORMATS, check, ensure_init, ffi, fptr, lib, vptr
from cpumla.native.weight import CACHE_DTYPES, F32, Weight, aligned_copy, as_weight, out_array


def gemv(w: Weight, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    ensure_init()
    as_weight(w)
    x = np.ascontiguousarray(checks.array(x, "x", F32, 1, (w.cols,)))
    y = out_array(out, "out", (w.rows,))
    check(lib.cpumla_gemv(w.c, fptr(x), fptr(y)))
    return y


def _tokens_x(w: Weight, x: np.ndarray) -> None:
    """Checks x [n, w.cols] float32 (rows may be strided), the activations of a gemm."""
    ensure_init()
    as_weight(w)
    checks.array(x, "x", F32, 2, (None, w.cols))


def gemm(w: Weight, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """x [n, cols] (rows may be strided) -> [n, rows]."""
    _tokens_x(w, x)
    y = out_array(out, "out", (x.shape[0], w.rows))
    check(lib.cpumla_gemm(w.c, fptr(x), ld(x), x.shape[0], fptr(y), ld(y)))
    return y


def gemm_f32act(w: Weight, x: np.ndarray) -> np.ndarray:
    """gemm with x as given even for bf16 weights (cpumla_gemm_f32act: the MoE router)."""
    _tokens_x(w, x)
    y = np.empty((x.shape[0], w.rows), F32)
    check(lib.cpumla_gemm_f32act(w.c, fptr(x), ld(x), x.shape[0], fptr(y), ld(y)))
    return y


def _heads(w, row0, head_stride, head_rows, x, x_cols: int | None):
    """Checks a per-head product: every head's rows inside the weight, x [n, H, x_cols] float32."""
    ensure_init()
    as_weight(w)
    row0 = checks.integer(row0, "row0")
    head_stride = checks.integer(head_stride, "head_stride")
    head_rows = checks.integer(head_rows, "head_rows")
    checks.array(x, "x", F32, 3)
    n, H, cols = x.shape
    if x_cols is None:
        x_cols = head_rows
    if cols != x_cols:
        raise CpumlaError(f"x has shape {x.shape}, want (n, H, {x_cols})")
    if H and head_rows and row0 + (H - 1) * head_stride + head_rows > w.rows:
        raise CpumlaError(f"heads reach weight row {row0 + (H - 1) * head_stride + head_rows}, "
                          f"but the weight has {w.rows} rows")
    return row0, head_stride, head_rows, n, H


def head_gemv(w: Weight, row0: int, head_stride: int, head_rows: int, x: np.ndarray,
              out: np.ndarray | None = None) -> np.ndarray:
    """x [n, H, cols] -> [n, H, head_rows]: y_h = W_h x_h (MLA un-absorb)."""
    row0, head_stride, head_rows, n, H = _heads(w, row0, head_stride, head_rows, x, w.cols)
    y = out_array(out, "out", (n, H, head_rows))
    check(lib.cpumla_head_gemv(w.c, row0, head_stride, head_rows, H, n, fptr(x), ld(x, 0), ld(x, 1),
                                fptr(y), ld(y, 0), ld(y, 1)))
    return y


def head_gemv_t(w: Weight, row0: int, head_stride: int, head_rows: int, x: np.ndarray,
                out: np.ndarray | None = None) -> np.ndarray:
    """x [n, H, head_rows] -> [n, H, cols]: y_h = W_h^T x_h (MLA absorb)."""
    row0, head_stride, head_rows, n, H = _heads(w, row0, head_stride, head_rows, x, None)
    y = out_array(out, "out", (n, H, w.cols))
    check(lib.cpumla_head_gemv_t(w.c, row0, head_stride, head_rows, H, n, fptr(x), ld(x, 0), ld(x, 1),
                                  fptr(y), ld(y, 0), ld(y, 1)))
    return y


def quantize(w: Weight, fmt: str, data: np.ndarray | None = None, scale: np.ndarray | None = None,
             rows: tuple[int, int] | None = None) -> Weight:
    """w (any other format) in q8 or q4 (cpumla.h: cpumla_quantize), on every thread. data / scale:
    where to put it (int8 [rows, cols] or uint8 [rows, cols/2]; float16 [rows, cols/32]), else new
    arrays. rows: only (r0, r1) of them (the rest left as they are), for progress in steps."""
    ensure_init()
    if fmt not in QUANT_FORMATS:
        raise CpumlaError(f"unknown quantized format '{fmt}' (choose from: {', '.join(QUANT_FORMATS)})")
    if w.cols % QBLOCK:
        raise CpumlaError(f"a {w.rows}x{w.cols} weight cannot be quantized: columns not a multiple of {QBLOCK}")
    if data is None:
        data = np.empty((w.rows, w.cols // (2 if fmt == "q4" else 1)), np.int8 if fmt == "q8" else np.uint8)
    if scale is None:
        scale = np.empty((w.rows, w.cols // QBLOCK), np.float16)
    out = Weight(data, fmt, scale, (1, QBLOCK))
    r0, r1 = rows or (0, w.rows)
    check(lib.cpumla_quantize(w.c, out.c, r0, r1))
    return out


def dequant(w: Weight) -> np.ndarray:
    ensure_init()
    as_weight(w)
    out = np.empty((w.rows, w.cols), F32)
    lib.cpumla_dequant(w.c, 0, w.rows, fptr(out), w.cols)
    return out


_VEC_KINDS = {np.dtype(np.float32): "CPUMLA_F32", np.dtype(np.uint16): "CPUMLA_BF16",
              np.dtype(np.float16): "CPUMLA_F16"}


def rmsnorm(x: np.ndarray, weight: np.ndarray | None, eps: float, out: np.ndarray | None = None):
    """Rows of x [n, dim] (strided rows allowed); weight [dim] float32, bf16 (uint16) or float16."""
    ensure_init()
    checks.array(x, "x", F32, 2)
    eps = checks.real(eps, "eps")
    y = out_array(out, "out", x.shape)
    wp, wd, keep = ffi.NULL, lib.CPUMLA_F32, None
    if weight is not None:
        checks.array(weight, "weight", tuple(_VEC_KINDS), 1, (x.shape[1],))
        keep = np.ascontiguousarray(weight)
        wp, wd = vptr(keep), getattr(lib, _VEC_KINDS[keep.dtype])
    lib.cpumla_rmsnorm(fptr(x), ld(x), fptr(y), ld(y), x.shape[0], x.shape[1], wp, wd, eps)
    return y


def rope(x: np.ndarray, pos: np.ndarray, inv_freq: np.ndarray, offset: int, rope_dim: int,
         mode: int = 0, attn_scale: float = 1.0) -> np.ndarray:
    """In place on x [n, H, head_dim] (rows and heads may be strided)."""
    ensure_init()
    checks.array(x, "x", F32, 3, writable=True)
    offset = checks.integer(offset, "offset")
    rope_dim = checks.integer(rope_dim, "rope_dim")
    mode = checks.integer(mode, "mode", 0, 3)
    attn_scale = checks.real(attn_scale, "attn_scale")
    if rope_dim % 2 or offset + rope_dim > x.shape[2]:
        raise CpumlaError(f"rope slice [{offset}, {offset + rope_dim}) must have an even width and fit "
                          f"the head dim {x.shape[2]}")
    pos = np.ascontiguousarray(checks.array(np.asarray(pos), "pos", (np.int64, np.int32), 1, (x.shape[0],)),
                               dtype=np.int64)
    inv_freq = checks.array(np.asarray(inv_freq), "inv_freq", (np.float32, np.float64), 1)
    if inv_freq.shape[0] < rope_dim // 2:
        raise CpumlaError(f"inv_freq has {inv_freq.shape[0]} values, rope_dim {rope_dim} needs {rope_dim // 2}")
    inv_freq = np.ascontiguousarray(inv_freq, dtype=F32)
    lib.cpumla_rope(fptr(x), x.shape[0], ld(x, 0), x.shape[1], ld(x, 1), offset, rope_dim,
                    vptr(pos, "int64_t *"), fptr(inv_freq), attn_scale, mode)
    return x


def swiglu(gate: np.ndarray, up: np.ndarray, limit: float = 0.0, out: np.ndarray | None = None):
    ensure_init()
    checks.array(gate, "gate", F32, 2)
    checks.array(up, "up", F32, 2, gate.shape)
    if ld(gate) != ld(up):
        raise CpumlaError("gate and up must have the same shape and row stride")
    limit = checks.real(limit, "limit")
    y = out_array(out, "out", gate.shape)
    lib.cpumla_swiglu(fptr(gate), fptr(up), ld(gate), fptr(y), ld(y), gate.shape[0], gate.shape[1], limit)
    return y


def softmax(x: np.ndarray) -> np.ndarray:
    """In place over the last axis of x [n, m]."""
    ensure_init()
    checks.array(x, "x", F32, 2, writable=True)
    lib.cpumla_softmax(fptr(x), x.shape[0], ld(x), x.shape[1])
    return x


def topk(x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k largest of x [n] (k may exceed n: the rest are index -1, value -inf)."""
    ensure_init()
    x = np.ascontiguousarray(checks.array(x, "x", F32, 1))
    k = checks.integer(k, "k", 0, max(x.shape[0], 1 << 20))
    idx = np.empty(k, np.int32)
    val = np.empty(k, F32)
    lib.cpumla_topk(fptr(x), x.shape[0], k, vptr(idx, "int32_t *"), fptr(val))
    return idx, val


def cache_store(cache: np.ndarray, src: np.ndarray, slots: np.ndarray) -> None:
    """cache [T, ld] float32 or uint16 (bf16); src [n, width <= ld] float32; slot -1 skipped."""
    ensure_init()
    checks.array(cache, "cache", CACHE_DTYPES, 2, writable=True)
    dt = lib.CPUMLA_BF16 if cache.dtype == np.uint16 else lib.CPUMLA_F32
    checks.array(src, "src", F32, 2)
    if src.shape[1] > cache.shape[1]:
        raise CpumlaError(f"src rows have {src.shape[1]} values, cache rows only {cache.shape[1]}")
    slots = checks.array(np.asarray(slots), "slots", (np.int64, np.int32), 1, (src.shape[0],))
    slots = np.ascontiguousarray(slots, dtype=np.int64)
    if np.any(slots >= cache.shape[0]):
        raise CpumlaError("a slot is past the end of the cache")
    check(lib.cpumla_cache_store(vptr(cache), dt, ld(cache), fptr(src), ld(src), src.shape[0], src.shape[1],
                                  vptr(slots, "int64_t *")))


def mla_attention(q: np.ndarray, kv: np.ndarray, dk: int, dv: int, scale: float,
                  kv_len: np.ndarray | None = None, kv_idx: np.ndarray | None = None,
                  sinks: np.ndarray | None = None, want_lse: bool = False):
    """q [n_q, H, >=dk] against kv [T, >=max(dk, dv)] (float32 or bf16 as uint16) -> out [n_q, H, dv]
    (, lse). Query i sees rows [0, kv_len[i]) (all T without kv_len), or with kv_idx [n_q, m] the rows
    kv_idx[i, :kv_len[i]] (all m without kv_len; entries < 0 or >= T skipped)."""
    ensure_init()
    checks.array(q, "q", F32, 3)
    checks.array(kv, "kv", CACHE_DTYPES, 2)
    dk = checks.integer(dk, "dk")
    dv = checks.integer(dv, "dv")
    scale = checks.real(scale, "scale")
    n_q, H = q.shape[0], q.shape[1]
    if dk > q.shape[2]:
        raise CpumlaError(f"dk {dk} is wider than the queries ({q.shape[2]})")
    if max(dk, dv) > kv.shape[1]:
        raise CpumlaError(f"dk {dk} / dv {dv} are wider than the kv rows ({kv.shape[1]})")
    a = ffi.new("cpumla_attn_args *")
    keep = []
    a.q, a.ldq_t, a.ldq_h, a.n_q, a.n_heads = fptr(q), ld(q, 0), ld(q, 1), n_q, H
    a.kv = vptr(kv)
    a.kv_dtype = lib.CPUMLA_BF16 if kv.dtype == np.uint16 else lib.CPUMLA_F32
    a.ld_kv, a.n_kv, a.dk, a.dv = ld(kv), kv.shape[0], dk, dv
    if kv_idx is not None:
        checks.array(np.asarray(kv_idx), "kv_idx", (np.int32, np.int64), 2, (n_q, None))
        kv_idx = np.ascontiguousarray(kv_idx, dtype=np.int32)
        if kv_len is None:
            kv_len = np.full(n_q, kv_idx.shape[1], np.int64)
    if kv_len is not None:
        checks.array(np.asarray(kv_len), "kv_len", (np.int64, np.int32), 1, (n_q,))
        kv_len = np.ascontiguousarray(kv_len, dtype=np.int64)
        if kv_idx is not None and n_q and kv_len.max() > kv_idx.shape[1]:
            raise CpumlaError(f"kv_len {int(kv_len.max())} is longer than the kv_idx rows ({kv_idx.shape[1]})")
        keep.append(kv_len)
        a.kv_len = vptr(kv_len, "int64_t *")
    if kv_idx is not None:
        keep.append(kv_idx)
        a.kv_idx, a.ld_idx = vptr(kv_idx, "int32_t *"), kv_idx.shape[1]
    if sinks is not None:
        checks.array(np.asarray(sinks), "sinks", (np.float32, np.float64), 1, (H,))
        sinks = np.ascontiguousarray(sinks, dtype=F32)
        keep.append(sinks)
        a.sinks = fptr(sinks)
    a.scale = scale
    out = np.empty((n_q, H, dv), F32)
    a.out, a.ldo_t, a.ldo_h = fptr(out), ld(out, 0), ld(out, 1)
    lse = np.empty((n_q, H), F32) if want_lse else None
    a.lse = fptr(lse) if want_lse else ffi.NULL
    check(lib.cpumla_mla_attention(a))
    return (out, lse) if want_lse else out


def mla_mha(q: np.ndarray, kv: np.ndarray, kv_b: Weight | None, rank: int, dn: int, dv: int, scale: float,
            kv_len: np.ndarray | None = None, k_b: Weight | None = None, v_b: Weight | None = None) -> np.ndarray:
    """Un-absorbed MLA attention (cpumla_mla_mha): q [n_q, H, dn + P] against the latent rows kv
    [T, >= rank + P] (float32 or bf16 as uint16; P = q's width - dn), keys and values decompressed with
    kv_b [H * (dn + dv), rank], or (kv_b None) with the pair k_b [H * rank, dn] (W_UK transposed per
    head) and v_b [H * dv, rank] -> out [n_q, H, dv]. Query i sees rows [0, kv_len[i]) (all T without)."""
    ensure_init()
    checks.array(q, "q", F32, 3)
    checks.array(kv, "kv", CACHE_DTYPES, 2)
    rank, dn, dv = (checks.integer(v, name) for v, name in ((rank, "rank"), (dn, "dn"), (dv, "dv")))
    scale = checks.real(scale, "scale")
    n_q, H = q.shape[0], q.shape[1]
    if kv.shape[1] < rank + q.shape[2] - dn:
        raise CpumlaError(f"kv rows ({kv.shape[1]}) are narrower than rank + rope width ({rank + q.shape[2] - dn})")
    a = ffi.new("cpumla_mla_mha_args *")
    a.q, a.ldq_t, a.ldq_h, a.n_q, a.n_heads = fptr(q), ld(q, 0), ld(q, 1), n_q, H
    a.kv = vptr(kv)
    a.kv_dtype = lib.CPUMLA_BF16 if kv.dtype == np.uint16 else lib.CPUMLA_F32
    a.ld_kv, a.n_kv, a.rank, a.rope_dim = ld(kv), kv.shape[0], rank, q.shape[2] - dn
    a.kv_b = as_weight(kv_b).c if kv_b is not None else ffi.NULL
    a.k_b = as_weight(k_b).c if k_b is not None else ffi.NULL
    a.v_b = as_weight(v_b).c if v_b is not None else ffi.NULL
    a.dn, a.dv = dn, dv
    if kv_len is not None:
        checks.array(np.asarray(kv_len), "kv_len", (np.int64, np.int32), 1, (n_q,))
        kv_len = np.ascontiguousarray(kv_len, dtype=np.int64)
        a.kv_len = vptr(kv_len, "int64_t *")
    a.scale = scale
    out = np.empty((n_q, H, max(dv, 0)), F32)
    a.out, a.ldo_t, a.ldo_h = fptr(out), ld(out, 0), ld(out, 1)
    check(lib.cpumla_mla_mha(a))
    return out


def read_probe(buf: np.ndarray) -> float:
    """Sum of buf's bytes read as float64 by every thread (the tail past a multiple of 64 is ignored)."""
    ensure_init()
    if not isinstance(buf, np.ndarray) or not buf.flags.c_contiguous:
        raise CpumlaError("read_probe needs a contiguous numpy array")
    if buf.ctypes.data % 64:                 # a stream split at cache lines, as the weights are
        buf = aligned_copy(buf)
    return lib.cpumla_read_probe(vptr(buf), buf.nbytes)
