"""Python face of the kernel library (cffi, API mode): implementation choice, and numpy-friendly
wrappers of each kernel for tests, benchmarks and load-time work. The runtime's per-token path calls
`lib` directly with preallocated buffers.

The implementation is chosen on first use: the best this CPU and OS run, or the one named by the
environment variable CPUMLA_ISA (scalar, avx2, avx512f, avx512, amx, neon). Asking for one that is not there is
a CpumlaError, never a crash.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from cpumla.errors import CpumlaError

try:
    from cpumla.native._cpumla import ffi, lib
except ImportError as e:  # pragma: no cover - only without a build
    raise CpumlaError(
        f"cpumla's kernel library is not built ({e}); install with `pip install .` or `make`"
    ) from None

ISAS = ("scalar", "avx2", "avx512f", "avx512", "amx", "neon")
KERNELS = tuple(ffi.string(lib.cpumla_kernel_names()).decode().split())
DTYPES = {"f32": lib.CPUMLA_F32, "bf16": lib.CPUMLA_BF16, "f16": lib.CPUMLA_F16,
          "e4m3": lib.CPUMLA_E4M3, "e2m1": lib.CPUMLA_E2M1}
_state = {"isa": None}


def _err() -> str:
    return ffi.string(lib.cpumla_last_error()).decode()


def _check(rc: int) -> None:
    """Raises CpumlaError with the library's message (this thread's) when a kernel returned -1."""
    if rc != 0:
        raise CpumlaError(_err() or "cpumla kernel failed")


last_error = _err


def init(isa: str | None = None) -> str:
    """Choose the implementation (None: $CPUMLA_ISA, else the best available). Returns its name."""
    if isa is None:
        isa = os.environ.get("CPUMLA_ISA", "").strip()
    if lib.cpumla_init(isa.encode()) != 0:
        source = " (from CPUMLA_ISA)" if isa and isa == os.environ.get("CPUMLA_ISA", "").strip() else ""
        raise CpumlaError(_err() + source)
    _state["isa"] = ffi.string(lib.cpumla_isa()).decode()
    return _state["isa"]


def ensure_init() -> str:
    return _state["isa"] or init()


def isa() -> str:
    return ensure_init()


def built_isas() -> list[str]:
    return ffi.string(lib.cpumla_isa_list()).decode().split()


def available_isas() -> list[str]:
    """Implementations built in that this CPU and OS can run, lowest first."""
    return [i for i in built_isas() if lib.cpumla_isa_available(i.encode())]


def set_threads(n: int | None) -> int:
    ensure_init()
    return lib.cpumla_set_threads(0 if n is None else int(n))


def get_threads() -> int:
    ensure_init()
    return lib.cpumla_get_threads()


FORMAT_KERNELS = ("gemv", "gemm", "head_gemv", "head_gemv_t", "dequant")


def kernel_impl(name: str) -> str:
    """The implementation serving a kernel ("gemv"), or one weight format of it ("gemv:e2m1")."""
    ensure_init()
    p = lib.cpumla_kernel_impl(name.encode())
    if p == ffi.NULL:
        raise CpumlaError(f"unknown kernel '{name}'")
    return ffi.string(p).decode()


def kernel_formats() -> dict[str, dict[str, str]]:
    """{kernel: {weight format: implementation that really serves it}} for the linear algebra."""
    return {k: {f: kernel_impl(f"{k}:{f}") for f in DTYPES} for k in FORMAT_KERNELS}


def cpu_features() -> dict[str, bool]:
    bits = lib.cpumla_cpu_features()
    out = {}
    for name in dir(lib):
        if name.startswith("CPUMLA_FEAT_"):
            out[name[len("CPUMLA_FEAT_"):].lower()] = bool(bits & getattr(lib, name))
    return out


def cpu_name() -> str:
    return ffi.string(lib.cpumla_cpu_name()).decode().strip()


def build_info() -> str:
    return ffi.string(lib.cpumla_build_info()).decode()


def isa_for_features(features: dict[str, bool] | int) -> str:
    """The implementation the dispatcher picks for a CPU with these features (cpu_features() names,
    or CPUMLA_FEAT_* bits): the rule itself, for CPUs other than this one."""
    if isinstance(features, dict):
        bits = 0
        for name, on in features.items():
            if on:
                bits |= getattr(lib, "CPUMLA_FEAT_" + name.upper())
        features = bits
    return ffi.string(lib.cpumla_isa_for_features(features)).decode()


def decode_operands(isa: str, fmt: str) -> tuple[np.ndarray, int]:
    """(operand of every code, k): the weight operands an implementation's GEMV loop multiplies for each
    code of fmt ("e4m3": 256, "e2m1": 16), with operand * 2^k = the code's value."""
    out = np.zeros(256, np.float32)
    k = lib.cpumla_decode_operands(f"{isa}:{fmt}".encode(), fptr(out))
    if k < 0:
        raise CpumlaError(f"no decode probe for {isa}:{fmt} on this machine")
    return out[: 256 if fmt == "e4m3" else 16], k


# ---- buffers ---------------------------------------------------------------------------------------
def _f32(a: np.ndarray, name: str, writable: bool = False) -> np.ndarray:
    if a.dtype != np.float32:
        raise CpumlaError(f"{name} must be float32, got {a.dtype}")
    if not a.flags.c_contiguous and not (a.ndim >= 1 and a.strides[-1] == 4):
        raise CpumlaError(f"{name} must have a contiguous last dimension")
    if writable and not a.flags.writeable:
        raise CpumlaError(f"{name} must be writable")
    return a


def fptr(a: np.ndarray):
    return ffi.cast("float *", a.ctypes.data)


def vptr(a: np.ndarray, ctype: str = "void *"):
    return ffi.cast(ctype, a.ctypes.data)


def ld(a: np.ndarray, axis: int = 0) -> int:
    """Stride of axis in elements."""
    return a.strides[axis] // a.itemsize


@dataclass
class Weight:
    """A [rows, cols] weight in a checkpoint format, described for the kernels without copying.

    data: float32 (f32), uint16 (bf16 bit patterns; or a torch-style bf16 viewed as uint16), float16
    (f16), uint8 (e4m3, or e2m1 packed two per byte: cols = 2 * bytes per row). scale: the block-scale
    grid, float32 or uint8 (E8M0). Rows may be strided (a slice of a bigger tensor); columns contiguous.
    """

    data: np.ndarray
    dtype: str
    scale: np.ndarray | None = None
    block: tuple[int, int] | None = None

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise CpumlaError(f"unknown weight dtype '{self.dtype}'")
        d = self.data
        if d.ndim != 2 or d.strides[1] != d.itemsize:
            raise CpumlaError("a weight must be 2-D with contiguous columns")
        want = {"f32": 4, "bf16": 2, "f16": 2, "e4m3": 1, "e2m1": 1}[self.dtype]
        if d.itemsize != want:
            raise CpumlaError(f"{self.dtype} weight needs {want}-byte elements, got {d.dtype}")
        self.rows = d.shape[0]
        self.cols = d.shape[1] * (2 if self.dtype == "e2m1" else 1)
        quant = self.dtype in ("e4m3", "e2m1")
        if quant and self.scale is None:
            raise CpumlaError(f"{self.dtype} weight needs a scale grid")
        c = ffi.new("cpumla_weight *")
        c.data = ffi.cast("void *", d.ctypes.data)
        c.rows, c.cols, c.row_bytes = self.rows, self.cols, d.strides[0]
        c.dtype = DTYPES[self.dtype]
        c.block_rows, c.block_cols = 1, 1
        if quant:
            s = self.scale
            block = self.block or ((128, 128) if self.dtype == "e4m3" else (1, 32))
            grid = (-(-self.rows // block[0]), -(-self.cols // block[1]))
            if s.ndim != 2 or tuple(s.shape) != grid or s.strides[1] != s.itemsize:
                raise CpumlaError(f"scale grid {tuple(s.shape)} does not fit a {self.rows}x{self.cols} "
                                  f"weight with {block[0]}x{block[1]} blocks (want {grid})")
            if s.dtype == np.float32:
                c.scale_dtype = lib.CPUMLA_F32
            elif s.dtype == np.uint8:
                c.scale_dtype = lib.CPUMLA_E8M0
            else:
                raise CpumlaError(f"scale must be float32 or uint8 (E8M0), got {s.dtype}")
            c.scale = ffi.cast("void *", s.ctypes.data)
            c.scale_ld = s.strides[0] // s.itemsize
            c.block_rows, c.block_cols = block
            self.block = block
        self.c = c

    @property
    def nbytes(self) -> int:
        n = self.data.shape[0] * self.data.shape[1] * self.data.itemsize
        return n + (self.scale.nbytes if self.scale is not None else 0)


# ---- kernels -----------------------------------------------------------------------------------
def gemv(w: Weight, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    ensure_init()
    x = np.ascontiguousarray(_f32(x, "x"))
    if x.shape != (w.cols,):
        raise CpumlaError(f"x has shape {x.shape}, weight wants ({w.cols},)")
    y = np.empty(w.rows, np.float32) if out is None else out
    _check(lib.cpumla_gemv(w.c, fptr(x), fptr(y)))
    return y


def _tokens_x(w: Weight, x: np.ndarray) -> None:
    """Checks x [n, w.cols] float32 (rows may be strided), the activations of a gemm."""
    ensure_init()
    _f32(x, "x")
    if x.ndim != 2 or x.shape[1] != w.cols:
        raise CpumlaError(f"x has shape {x.shape}, weight wants (n, {w.cols})")


def gemm(w: Weight, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """x [n, cols] (rows may be strided) -> [n, rows]."""
    _tokens_x(w, x)
    y = np.empty((x.shape[0], w.rows), np.float32) if out is None else out
    _check(lib.cpumla_gemm(w.c, fptr(x), ld(x), x.shape[0], fptr(y), ld(y)))
    return y


def gemm_f32act(w: Weight, x: np.ndarray) -> np.ndarray:
    """gemm with x as given even for bf16 weights (cpumla_gemm_f32act: the MoE router)."""
    _tokens_x(w, x)
    y = np.empty((x.shape[0], w.rows), np.float32)
    _check(lib.cpumla_gemm_f32act(w.c, fptr(x), ld(x), x.shape[0], fptr(y), ld(y)))
    return y


def head_gemv(w: Weight, row0: int, head_stride: int, head_rows: int, x: np.ndarray,
              out: np.ndarray | None = None) -> np.ndarray:
    """x [n, H, cols] -> [n, H, head_rows]: y_h = W_h x_h (MLA un-absorb)."""
    ensure_init()
    _f32(x, "x")
    n, H, _ = x.shape
    y = np.empty((n, H, head_rows), np.float32) if out is None else out
    _check(lib.cpumla_head_gemv(w.c, row0, head_stride, head_rows, H, n, fptr(x), ld(x, 0), ld(x, 1),
                                fptr(y), ld(y, 0), ld(y, 1)))
    return y


def head_gemv_t(w: Weight, row0: int, head_stride: int, head_rows: int, x: np.ndarray,
                out: np.ndarray | None = None) -> np.ndarray:
    """x [n, H, head_rows] -> [n, H, cols]: y_h = W_h^T x_h (MLA absorb)."""
    ensure_init()
    _f32(x, "x")
    n, H, _ = x.shape
    y = np.empty((n, H, w.cols), np.float32) if out is None else out
    _check(lib.cpumla_head_gemv_t(w.c, row0, head_stride, head_rows, H, n, fptr(x), ld(x, 0), ld(x, 1),
                                  fptr(y), ld(y, 0), ld(y, 1)))
    return y


def dequant(w: Weight) -> np.ndarray:
    ensure_init()
    out = np.empty((w.rows, w.cols), np.float32)
    lib.cpumla_dequant(w.c, 0, w.rows, fptr(out), w.cols)
    return out


def _vec(weight: np.ndarray | None):
    if weight is None:
        return ffi.NULL, lib.CPUMLA_F32
    kind = {np.dtype(np.float32): lib.CPUMLA_F32, np.dtype(np.uint16): lib.CPUMLA_BF16,
            np.dtype(np.float16): lib.CPUMLA_F16}.get(weight.dtype)
    if kind is None:
        raise CpumlaError(f"norm weight must be float32, bf16 (uint16) or float16, got {weight.dtype}")
    return vptr(np.ascontiguousarray(weight)), kind


def rmsnorm(x: np.ndarray, weight: np.ndarray | None, eps: float, out: np.ndarray | None = None):
    """Rows of x [n, dim] (strided rows allowed)."""
    ensure_init()
    _f32(x, "x")
    y = np.empty(x.shape, np.float32) if out is None else out
    keep = np.ascontiguousarray(weight) if weight is not None else None
    wp, wd = _vec(keep)
    lib.cpumla_rmsnorm(fptr(x), ld(x), fptr(y), ld(y), x.shape[0], x.shape[1], wp, wd, eps)
    return y


def rope(x: np.ndarray, pos: np.ndarray, inv_freq: np.ndarray, offset: int, rope_dim: int,
         mode: int = 0, attn_scale: float = 1.0) -> np.ndarray:
    """In place on x [n, H, head_dim] (rows and heads may be strided)."""
    ensure_init()
    _f32(x, "x", writable=True)
    pos = np.ascontiguousarray(pos, dtype=np.int64)
    inv_freq = np.ascontiguousarray(inv_freq, dtype=np.float32)
    lib.cpumla_rope(fptr(x), x.shape[0], ld(x, 0), x.shape[1], ld(x, 1), offset, rope_dim,
                    vptr(pos, "int64_t *"), fptr(inv_freq), attn_scale, mode)
    return x


def swiglu(gate: np.ndarray, up: np.ndarray, limit: float = 0.0, out: np.ndarray | None = None):
    ensure_init()
    if gate.shape != up.shape or ld(gate) != ld(up):
        raise CpumlaError("gate and up must have the same shape and row stride")
    y = np.empty(gate.shape, np.float32) if out is None else out
    lib.cpumla_swiglu(fptr(gate), fptr(up), ld(gate), fptr(y), ld(y), gate.shape[0], gate.shape[1], limit)
    return y


def softmax(x: np.ndarray) -> np.ndarray:
    """In place over the last axis of x [n, m]."""
    ensure_init()
    _f32(x, "x", writable=True)
    lib.cpumla_softmax(fptr(x), x.shape[0], ld(x), x.shape[1])
    return x


def topk(x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    x = np.ascontiguousarray(_f32(x, "x"))
    idx = np.empty(k, np.int32)
    val = np.empty(k, np.float32)
    lib.cpumla_topk(fptr(x), x.shape[0], k, vptr(idx, "int32_t *"), fptr(val))
    return idx, val


ROUTE_METHODS = {"softmax": lib.CPUMLA_ROUTE_SOFTMAX, "group_limited": lib.CPUMLA_ROUTE_GROUP_LIMITED,
                 "noaux_tc": lib.CPUMLA_ROUTE_NOAUX_TC, "sqrtsoftplus": lib.CPUMLA_ROUTE_SQRTSOFTPLUS,
                 "hash": lib.CPUMLA_ROUTE_HASH}


class Router:
    """A cpumla_router with the arrays it points at kept alive."""

    def __init__(self, method: str, n_experts: int, top_k: int, n_group: int = 1, topk_group: int = 1,
                 norm_topk_prob: bool = False, routed_scaling_factor: float = 1.0,
                 bias: np.ndarray | None = None, tid2eid: np.ndarray | None = None):
        if method not in ROUTE_METHODS:
            raise CpumlaError(f"unknown routing method '{method}'")
        r = ffi.new("cpumla_router *")
        r.method = ROUTE_METHODS[method]
        r.n_experts, r.top_k, r.n_group, r.topk_group = n_experts, top_k, n_group, topk_group
        r.norm_topk_prob, r.routed_scaling_factor = int(norm_topk_prob), routed_scaling_factor
        self._bias = None if bias is None else np.ascontiguousarray(bias, dtype=np.float32)
        r.bias = ffi.NULL if self._bias is None else fptr(self._bias)
        self._t = None
        if tid2eid is not None:
            self._t = np.ascontiguousarray(tid2eid)
            if self._t.dtype not in (np.int64, np.int32):
                raise CpumlaError("tid2eid must be int64 or int32")
            r.tid2eid = vptr(self._t)
            r.tid2eid_dtype = lib.CPUMLA_I64 if self._t.dtype == np.int64 else lib.CPUMLA_I32
            r.vocab = self._t.shape[0]
        self.c = r
        self.top_k = top_k

    def __call__(self, logits: np.ndarray, token_ids: np.ndarray | None = None):
        _f32(logits, "logits")
        n = logits.shape[0]
        idx = np.empty((n, self.top_k), np.int32)
        w = np.empty((n, self.top_k), np.float32)
        ids = None if token_ids is None else np.ascontiguousarray(token_ids, dtype=np.int64)
        rc = lib.cpumla_route(self.c, fptr(logits), ld(logits), n,
                              ffi.NULL if ids is None else vptr(ids, "int64_t *"),
                              vptr(idx, "int32_t *"), fptr(w))
        _check(rc)
        return idx, w


def cache_store(cache: np.ndarray, src: np.ndarray, slots: np.ndarray) -> None:
    """cache [T, ld] float32 or uint16 (bf16); src [n, width] float32; slot -1 skipped."""
    ensure_init()
    dt = lib.CPUMLA_BF16 if cache.dtype == np.uint16 else lib.CPUMLA_F32
    if cache.dtype not in (np.uint16, np.float32):
        raise CpumlaError("cache must be float32 or bf16 (uint16)")
    slots = np.ascontiguousarray(slots, dtype=np.int64)
    if np.any(slots >= cache.shape[0]):
        raise CpumlaError("a slot is past the end of the cache")
    _check(lib.cpumla_cache_store(vptr(cache), dt, ld(cache), fptr(src), ld(src), src.shape[0], src.shape[1],
                                  vptr(slots, "int64_t *")))


def mla_attention(q: np.ndarray, kv: np.ndarray, dk: int, dv: int, scale: float,
                  kv_len: np.ndarray | None = None, kv_idx: np.ndarray | None = None,
                  sinks: np.ndarray | None = None, want_lse: bool = False):
    """q [n_q, H, >=dk] against kv [T, >=dk] (float32 or bf16 as uint16) -> out [n_q, H, dv] (, lse)."""
    ensure_init()
    _f32(q, "q")
    n_q, H = q.shape[0], q.shape[1]
    a = ffi.new("cpumla_attn_args *")
    keep = []
    a.q, a.ldq_t, a.ldq_h, a.n_q, a.n_heads = fptr(q), ld(q, 0), ld(q, 1), n_q, H
    a.kv = vptr(kv)
    a.kv_dtype = lib.CPUMLA_BF16 if kv.dtype == np.uint16 else lib.CPUMLA_F32
    a.ld_kv, a.n_kv, a.dk, a.dv = ld(kv), kv.shape[0], dk, dv
    if kv_len is not None:
        kv_len = np.ascontiguousarray(kv_len, dtype=np.int64)
        keep.append(kv_len)
        a.kv_len = vptr(kv_len, "int64_t *")
    if kv_idx is not None:
        kv_idx = np.ascontiguousarray(kv_idx, dtype=np.int32)
        keep.append(kv_idx)
        a.kv_idx, a.ld_idx = vptr(kv_idx, "int32_t *"), kv_idx.shape[1]
    if sinks is not None:
        sinks = np.ascontiguousarray(sinks, dtype=np.float32)
        keep.append(sinks)
        a.sinks = fptr(sinks)
    a.scale = scale
    out = np.empty((n_q, H, dv), np.float32)
    a.out, a.ldo_t, a.ldo_h = fptr(out), ld(out, 0), ld(out, 1)
    lse = np.empty((n_q, H), np.float32) if want_lse else None
    a.lse = fptr(lse) if want_lse else ffi.NULL
    _check(lib.cpumla_mla_attention(a))
    return (out, lse) if want_lse else out


def read_probe(buf: np.ndarray) -> float:
    ensure_init()
    return lib.cpumla_read_probe(vptr(buf), buf.nbytes)


class Experts:
    """A table of SwiGLU MLPs (cpumla_expert[]) for cpumla_moe; keeps its Weights alive."""

    def __init__(self, experts: list[tuple[Weight, Weight, Weight]]):
        if not experts:
            raise CpumlaError("an expert table needs at least one expert")
        self._keep = experts
        self.c = ffi.new("cpumla_expert[]", len(experts))
        I, D = experts[0][0].rows, experts[0][0].cols
        for i, (g, u, d) in enumerate(experts):
            if (g.rows, g.cols, u.rows, u.cols, d.rows, d.cols) != (I, D, I, D, D, I):
                raise CpumlaError(f"expert {i} has shapes {g.rows}x{g.cols}/{u.rows}x{u.cols}/{d.rows}x{d.cols}, "
                                  f"want {I}x{D}/{I}x{D}/{D}x{I}")
            self.c[i].gate, self.c[i].up, self.c[i].down = g.c[0], u.c[0], d.c[0]
        self.n, self.hidden, self.intermediate = len(experts), D, I

    def __call__(self, x: np.ndarray, idx: np.ndarray, w: np.ndarray, out: np.ndarray, limit: float = 0.0):
        """out[t] += sum_j w[t, j] * Expert_{idx[t, j]}(x[t]); x, out [n, D]; idx, w [n, k]."""
        ensure_init()
        idx = np.ascontiguousarray(idx, dtype=np.int32)
        w = np.ascontiguousarray(w, dtype=np.float32)
        rc = lib.cpumla_moe(self.c, self.n, fptr(x), ld(x), x.shape[0], vptr(idx, "int32_t *"), fptr(w),
                            idx.shape[1], fptr(out), ld(out), limit)
        _check(rc)
        return out


# ---- model descriptions ----------------------------------------------------------------------------
_VEC_DTYPES = {np.dtype(np.float32): lib.CPUMLA_F32, np.dtype(np.uint16): lib.CPUMLA_BF16,
               np.dtype(np.float16): lib.CPUMLA_F16}
_FORMATS = {np.dtype(np.float32): "f32", np.dtype(np.uint16): "bf16", np.dtype(np.float16): "f16"}


def set_vec(c, v: np.ndarray) -> None:
    """Points a cpumla_vec at v (float32, bf16 bits as uint16, or float16) in place; v must outlive it."""
    if v.dtype not in _VEC_DTYPES or not v.flags.c_contiguous:
        raise CpumlaError(f"a vector must be contiguous float32, bf16 or float16, got {v.dtype}")
    c.data, c.dtype = vptr(v), _VEC_DTYPES[v.dtype]


def format_of(a: np.ndarray) -> str:
    """The weight format of a plain array: f32, bf16 (uint16 bits) or f16."""
    if a.dtype not in _FORMATS:
        raise CpumlaError(f"no weight format for {a.dtype}")
    return _FORMATS[a.dtype]
