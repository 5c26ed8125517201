"""Python face of the kernel library (cffi, API mode): implementation choice, and numpy-friendly
wrappers of each kernel for tests, benchmarks and load-time work. The runtime's per-token path calls
`lib` directly with preallocated buffers.

The implementation is chosen on first use: the best this CPU and OS run, or the one named by the
environment variable CPUMLA_ISA (scalar, avx2, avxvnni, avx512f, avx512vnni, avx512, amx, neon). Asking for one that is not there is
a CpumlaError, never a crash. CPUMLA_PREFETCH (l1, l2, l2+l1, auto) overrides where the GEMVs prefetch
their weights (gemv_prefetch(); the CPU's own choice by default).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from cpumla.errors import CpumlaError
from cpumla.native import checks

try:
    from cpumla.native._cpumla import ffi, lib
except ImportError as e:  # pragma: no cover - only without a build
    raise CpumlaError(
        f"cpumla's kernel library is not built ({e}); install with `pip install .` or `make`"
    ) from None

ISAS = ("scalar", "avx2", "avxvnni", "avx512f", "avx512vnni", "avx512", "amx", "neon")
KERNELS = tuple(ffi.string(lib.cpumla_kernel_names()).decode().split())
DTYPES = {"f32": lib.CPUMLA_F32, "bf16": lib.CPUMLA_BF16, "f16": lib.CPUMLA_F16,
          "e4m3": lib.CPUMLA_E4M3, "e2m1": lib.CPUMLA_E2M1, "q8": lib.CPUMLA_Q8, "q4": lib.CPUMLA_Q4}
QUANT_FORMATS = ("q8", "q4")     # cpumla's own block formats (cpumla.h): made by quantize()
QBLOCK = 32
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
    where = os.environ.get("CPUMLA_PREFETCH", "").strip()
    if where and lib.cpumla_set_gemv_prefetch(where.encode()) != 0:
        raise CpumlaError(_err() + " (from CPUMLA_PREFETCH)")
    return _state["isa"]


def set_gemv_prefetch(where: str) -> None:
    """Where the GEMVs prefetch their weight rows: "l1", "l2", "l2+l1" (into L2, and again nearer into
    L1) for every stream, or "auto" (this CPU's own, as cpumla_init picks it: the AVX-512 integer and
    e4m3 loops and the others apart). Results are the same bits either way."""
    _check(lib.cpumla_set_gemv_prefetch(where.encode()))


def gemv_prefetch() -> str:
    """"l1", "l2" or "l2+l1", and why in parentheses (cpumla.h cpumla_gemv_prefetch)."""
    ensure_init()
    return ffi.string(lib.cpumla_gemv_prefetch()).decode()


def ensure_init() -> str:
    return _state["isa"] or init()


def isa() -> str:
    return ensure_init()


def built_isas() -> list[str]:
    return ffi.string(lib.cpumla_isa_list()).decode().split()


def available_isas() -> list[str]:
    """Implementations built in that this CPU and OS can run, lowest first."""
    return [i for i in built_isas() if lib.cpumla_isa_available(i.encode())]


MAX_THREADS = 256      # the pool's size, CPUMLA_MAX_THREADS in csrc/threadpool.h


def set_threads(n: int | None) -> int:
    """n threads (None or 0: one per online core); more than MAX_THREADS is a CpumlaError, never a
    silent cap. Returns the count now running."""
    ensure_init()
    n = 0 if n is None else checks.integer(n, "threads", 0, MAX_THREADS)
    return lib.cpumla_set_threads(n)


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
    code of fmt ("e4m3": 256 codes), with operand * 2^k = the code's value. ("e2m1" has none: its
    products multiply integers, kernels.h.)"""
    out = np.zeros(256, np.float32)
    k = lib.cpumla_decode_operands(f"{isa}:{fmt}".encode(), fptr(out))
    if k < 0:
        raise CpumlaError(f"no decode probe for {isa}:{fmt} on this machine")
    return out[: 256 if fmt == "e4m3" else 16], k


# ---- buffers ---------------------------------------------------------------------------------------
F32 = np.float32
_KV = (np.float32, np.uint16)                # a cache: float32, or bf16 bits as uint16


def _out(out, name: str, shape: tuple) -> np.ndarray:
    """A result buffer: a new float32 array of `shape`, or `out` checked to be exactly that."""
    if out is None:
        return np.empty(shape, F32)
    return checks.array(out, name, F32, len(shape), shape, writable=True)


def fptr(a: np.ndarray):
    return ffi.cast("float *", a.ctypes.data)


def vptr(a: np.ndarray, ctype: str = "void *"):
    return ffi.cast(ctype, a.ctypes.data)


ld = checks.ld


@dataclass
class Weight:
    """A [rows, cols] weight in a checkpoint format, described for the kernels without copying.

    data: float32 (f32), uint16 (bf16 bit patterns; or a torch-style bf16 viewed as uint16), float16
    (f16), uint8 (e4m3, or e2m1 packed two per byte: cols = 2 * bytes per row), int8 (q8), uint8 (q4,
    two 4-bit codes per byte, cpumla.h's order). scale: the block-scale grid, float32 or uint8 (E8M0);
    float16 [rows, cols/32] for q8 / q4. Rows may be strided (a slice of a bigger tensor); columns
    contiguous.
    """

    data: np.ndarray
    dtype: str
    scale: np.ndarray | None = None
    block: tuple[int, int] | None = None

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise CpumlaError(f"unknown weight dtype '{self.dtype}'")
        if not isinstance(self.data, np.ndarray):
            raise CpumlaError(f"a weight must be a numpy array, got {type(self.data).__name__}")
        d = self.data
        if d.ndim != 2 or (d.shape[1] > 1 and d.strides[1] != d.itemsize):
            raise CpumlaError("a weight must be 2-D with contiguous columns")
        want = {"f32": 4, "bf16": 2, "f16": 2, "e4m3": 1, "e2m1": 1, "q8": 1, "q4": 1}[self.dtype]
        if d.itemsize != want or d.dtype.kind not in "fui":
            raise CpumlaError(f"{self.dtype} weight needs {want}-byte elements, got {d.dtype}")
        checks.array(d, "weight", d.dtype, 2)
        self.rows = d.shape[0]
        self.cols = d.shape[1] * (2 if self.dtype in ("e2m1", "q4") else 1)
        quant = self.dtype in ("e4m3", "e2m1", "q8", "q4")
        own = self.dtype in QUANT_FORMATS
        if own and (self.cols % QBLOCK or self.cols == 0):
            raise CpumlaError(f"a {self.dtype} weight needs a positive multiple of {QBLOCK} columns, got {self.cols}")
        if own and self.block not in (None, (1, QBLOCK)):
            raise CpumlaError(f"a {self.dtype} weight has 1x{QBLOCK} blocks, not {self.block}")
        if quant and self.scale is None:
            raise CpumlaError(f"{self.dtype} weight needs a scale grid")
        if not quant and self.scale is not None:
            raise CpumlaError(f"a {self.dtype} weight takes no scale grid")
        c = ffi.new("cpumla_weight *")
        c.data = ffi.cast("void *", d.ctypes.data)
        c.rows, c.cols, c.row_bytes = self.rows, self.cols, ld(d) * d.itemsize
        c.dtype = DTYPES[self.dtype]
        c.block_rows, c.block_cols = 1, 1
        if quant:
            block = self.block or ((128, 128) if self.dtype == "e4m3" else (1, 32))
            if (not isinstance(block, (tuple, list)) or len(block) != 2
                    or not all(isinstance(b, int) and not isinstance(b, bool) and 1 <= b <= checks.I32_MAX
                               for b in block)):
                raise CpumlaError(f"block {block!r} is not two positive integers")
            s = checks.array(self.scale, "scale", (np.float16,) if own else (np.float32, np.uint8), 2)
            grid = (-(-self.rows // block[0]), -(-self.cols // block[1]))
            if tuple(s.shape) != grid:
                raise CpumlaError(f"scale grid {tuple(s.shape)} does not fit a {self.rows}x{self.cols} "
                                  f"weight with {block[0]}x{block[1]} blocks (want {grid})")
            c.scale_dtype = lib.CPUMLA_F16 if own else lib.CPUMLA_F32 if s.dtype == np.float32 else lib.CPUMLA_E8M0
            c.scale = ffi.cast("void *", s.ctypes.data)
            c.scale_ld = ld(s)
            c.block_rows, c.block_cols = block
            self.block = tuple(block)
        self.c = c

    @property
    def nbytes(self) -> int:
        n = self.data.shape[0] * self.data.shape[1] * self.data.itemsize
        return n + (self.scale.nbytes if self.scale is not None else 0)


def _weight(w) -> Weight:
    if not isinstance(w, Weight):
        raise CpumlaError(f"w must be a cpumla.native.Weight, got {type(w).__name__}")
    return w


# ---- kernels -----------------------------------------------------------------------------------
def gemv(w: Weight, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    ensure_init()
    _weight(w)
    x = np.ascontiguousarray(checks.array(x, "x", F32, 1, (w.cols,)))
    y = _out(out, "out", (w.rows,))
    _check(lib.cpumla_gemv(w.c, fptr(x), fptr(y)))
    return y


def _tokens_x(w: Weight, x: np.ndarray) -> None:
    """Checks x [n, w.cols] float32 (rows may be strided), the activations of a gemm."""
    ensure_init()
    _weight(w)
    checks.array(x, "x", F32, 2, (None, w.cols))


def gemm(w: Weight, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """x [n, cols] (rows may be strided) -> [n, rows]."""
    _tokens_x(w, x)
    y = _out(out, "out", (x.shape[0], w.rows))
    _check(lib.cpumla_gemm(w.c, fptr(x), ld(x), x.shape[0], fptr(y), ld(y)))
    return y


def gemm_f32act(w: Weight, x: np.ndarray) -> np.ndarray:
    """gemm with x as given even for bf16 weights (cpumla_gemm_f32act: the MoE router)."""
    _tokens_x(w, x)
    y = np.empty((x.shape[0], w.rows), F32)
    _check(lib.cpumla_gemm_f32act(w.c, fptr(x), ld(x), x.shape[0], fptr(y), ld(y)))
    return y


def _heads(w, row0, head_stride, head_rows, x, x_cols: int | None):
    """Checks a per-head product: every head's rows inside the weight, x [n, H, x_cols] float32."""
    ensure_init()
    _weight(w)
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
    y = _out(out, "out", (n, H, head_rows))
    _check(lib.cpumla_head_gemv(w.c, row0, head_stride, head_rows, H, n, fptr(x), ld(x, 0), ld(x, 1),
                                fptr(y), ld(y, 0), ld(y, 1)))
    return y


def head_gemv_t(w: Weight, row0: int, head_stride: int, head_rows: int, x: np.ndarray,
                out: np.ndarray | None = None) -> np.ndarray:
    """x [n, H, head_rows] -> [n, H, cols]: y_h = W_h^T x_h (MLA absorb)."""
    row0, head_stride, head_rows, n, H = _heads(w, row0, head_stride, head_rows, x, None)
    y = _out(out, "out", (n, H, w.cols))
    _check(lib.cpumla_head_gemv_t(w.c, row0, head_stride, head_rows, H, n, fptr(x), ld(x, 0), ld(x, 1),
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
    _check(lib.cpumla_quantize(w.c, out.c, r0, r1))
    return out


def dequant(w: Weight) -> np.ndarray:
    ensure_init()
    _weight(w)
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
    y = _out(out, "out", x.shape)
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
    y = _out(out, "out", gate.shape)
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
    checks.array(cache, "cache", _KV, 2, writable=True)
    dt = lib.CPUMLA_BF16 if cache.dtype == np.uint16 else lib.CPUMLA_F32
    checks.array(src, "src", F32, 2)
    if src.shape[1] > cache.shape[1]:
        raise CpumlaError(f"src rows have {src.shape[1]} values, cache rows only {cache.shape[1]}")
    slots = checks.array(np.asarray(slots), "slots", (np.int64, np.int32), 1, (src.shape[0],))
    slots = np.ascontiguousarray(slots, dtype=np.int64)
    if np.any(slots >= cache.shape[0]):
        raise CpumlaError("a slot is past the end of the cache")
    _check(lib.cpumla_cache_store(vptr(cache), dt, ld(cache), fptr(src), ld(src), src.shape[0], src.shape[1],
                                  vptr(slots, "int64_t *")))


def mla_attention(q: np.ndarray, kv: np.ndarray, dk: int, dv: int, scale: float,
                  kv_len: np.ndarray | None = None, kv_idx: np.ndarray | None = None,
                  sinks: np.ndarray | None = None, want_lse: bool = False):
    """q [n_q, H, >=dk] against kv [T, >=max(dk, dv)] (float32 or bf16 as uint16) -> out [n_q, H, dv]
    (, lse). Query i sees rows [0, kv_len[i]) (all T without kv_len), or with kv_idx [n_q, m] the rows
    kv_idx[i, :kv_len[i]] (all m without kv_len; entries < 0 or >= T skipped)."""
    ensure_init()
    checks.array(q, "q", F32, 3)
    checks.array(kv, "kv", _KV, 2)
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
    _check(lib.cpumla_mla_attention(a))
    return (out, lse) if want_lse else out


def mla_mha(q: np.ndarray, kv: np.ndarray, kv_b: Weight, rank: int, dn: int, dv: int, scale: float,
            kv_len: np.ndarray | None = None) -> np.ndarray:
    """Un-absorbed MLA attention (cpumla_mla_mha): q [n_q, H, dn + P] against the latent rows kv
    [T, >= rank + P] (float32 or bf16 as uint16; P = q's width - dn), keys and values decompressed with
    kv_b [H * (dn + dv), rank] -> out [n_q, H, dv]. Query i sees rows [0, kv_len[i]) (all T without)."""
    ensure_init()
    checks.array(q, "q", F32, 3)
    checks.array(kv, "kv", _KV, 2)
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
    a.kv_b, a.dn, a.dv = _weight(kv_b).c, dn, dv
    if kv_len is not None:
        checks.array(np.asarray(kv_len), "kv_len", (np.int64, np.int32), 1, (n_q,))
        kv_len = np.ascontiguousarray(kv_len, dtype=np.int64)
        a.kv_len = vptr(kv_len, "int64_t *")
    a.scale = scale
    out = np.empty((n_q, H, max(dv, 0)), F32)
    a.out, a.ldo_t, a.ldo_h = fptr(out), ld(out, 0), ld(out, 1)
    _check(lib.cpumla_mla_mha(a))
    return out


def read_probe(buf: np.ndarray) -> float:
    """Sum of buf's bytes read as float64 by every thread (the tail past a multiple of 64 is ignored)."""
    ensure_init()
    if not isinstance(buf, np.ndarray) or not buf.flags.c_contiguous:
        raise CpumlaError("read_probe needs a contiguous numpy array")
    if buf.ctypes.data % 64:                 # a stream split at cache lines, as the weights are
        buf = aligned_copy(buf)
    return lib.cpumla_read_probe(vptr(buf), buf.nbytes)


def aligned_copy(a: np.ndarray, align: int = 64) -> np.ndarray:
    """A copy of a whose data starts at a multiple of `align` bytes."""
    raw = np.empty(a.nbytes + align, np.uint8)
    off = (-raw.ctypes.data) % align
    out = raw[off:off + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    return out


# the model-description helpers (routers, expert tables, vectors) live in native/model.py
from cpumla.native.model import ROUTE_METHODS, Experts, Router, format_of, set_vec  # noqa: E402,F401
