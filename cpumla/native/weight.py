"""Weights and buffers as the kernels take them: a checkpoint tensor described without a copy (Weight),
result arrays, aligned copies."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cpumla.errors import CpumlaError
from cpumla.native import checks
from cpumla.native.checks import ld
from cpumla.native.library import DTYPES, GGUF_FORMATS, QBLOCK, QUANT_FORMATS, ffi, lib

F32 = np.float32
CACHE_DTYPES = (np.float32, np.uint16)       # a cache: float32, or bf16 bits as uint16


def out_array(out, name: str, shape: tuple) -> np.ndarray:
    """A result buffer: a new float32 array of `shape`, or `out` checked to be exactly that."""
    if out is None:
        return np.empty(shape, F32)
    return checks.array(out, name, F32, len(shape), shape, writable=True)


@dataclass
class Weight:
    """A [rows, cols] weight in a checkpoint format, described for the kernels without copying.

    data: float32 (f32), uint16 (bf16 bit patterns; or a torch-style bf16 viewed as uint16), float16
    (f16), uint8 (e4m3, or e2m1 packed two per byte: cols = 2 * bytes per row), int8 (q8), uint8 (q4,
    two 4-bit codes per byte, cpumla.h's order), uint8 (a GGUF block type, library.GGUF_FORMATS: whole blocks
    with their scales inside, e.g. q8_0's 34 bytes for 32 weights: cols = 32 * bytes per row / 34). scale: the block-scale grid, float32 or uint8 (E8M0);
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
        want = 1 if self.dtype in GGUF_FORMATS else {"f32": 4, "bf16": 2, "f16": 2, "e4m3": 1, "e2m1": 1, "q8": 1,
                                                     "q4": 1}[self.dtype]
        if d.itemsize != want or d.dtype.kind not in "fui":
            raise CpumlaError(f"{self.dtype} weight needs {want}-byte elements, got {d.dtype}")
        checks.array(d, "weight", d.dtype, 2)
        self.rows = d.shape[0]
        self.cols = d.shape[1] * (2 if self.dtype in ("e2m1", "q4") else 1)
        if self.dtype in GGUF_FORMATS:
            cols, per = GGUF_FORMATS[self.dtype]
            if d.shape[1] % per or d.shape[1] == 0:
                raise CpumlaError(f"a {self.dtype} weight holds whole {per}-byte blocks, got {d.shape[1]} bytes a row")
            if self.scale is not None or self.block not in (None, (1, cols)):
                raise CpumlaError(f"a {self.dtype} weight has its scales in its blocks: no scale grid")
            self.cols = d.shape[1] // per * cols
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
        c.block_rows, c.block_cols = (1, GGUF_FORMATS[self.dtype][0]) if self.dtype in GGUF_FORMATS else (1, 1)
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

    def block_unit(self, axis: int) -> int:
        """The rows (axis 0) or columns (axis 1) of one block of the format: what a slice keeps whole."""
        if self.dtype in GGUF_FORMATS:
            return (1, GGUF_FORMATS[self.dtype][0])[axis]
        return (self.block or (1, 1))[axis]

    def part(self, axis: int, a: int, b: int, name: str = "a weight") -> "Weight":
        """Rows (axis 0) or columns (axis 1) [a, b) of this weight: the slice a rank of tensor parallel
        holds. Rows are a view; columns a contiguous copy (64-byte aligned), read once here: the GEMVs
        stream a weight row after row and prefetch ahead in memory, which in a strided slice is the
        other ranks' columns (and on a two-socket server the copy lands in the rank's own memory).
        CpumlaError, naming `name`, when the slice cuts through a block of the format (FP8's 128x128,
        q8 / q4's and FP4's 1x32, a GGUF block)."""
        size = self.rows if axis == 0 else self.cols
        gguf = self.dtype in GGUF_FORMATS
        unit = self.block_unit(axis)
        if not 0 <= a < b <= size:
            raise CpumlaError(f"{name}: no {'rows' if axis == 0 else 'columns'} {a}..{b} in {self.rows}x{self.cols}")
        if a % unit or (b % unit and b != size):
            what = f"{self.block[0]}x{self.block[1]}" if self.block else f"{unit}-wide"
            raise CpumlaError(f"{name}: {'rows' if axis == 0 else 'columns'} {a}..{b} of {size} cut through its "
                              f"{what} {self.dtype} blocks")
        scale = self.scale
        if axis == 0:
            data = self.data[a:b]
            if scale is not None:
                scale = scale[a // unit:-(-b // unit)]
        else:
            if gguf:
                cols, per = GGUF_FORMATS[self.dtype]
                data = self.data[:, a // cols * per:-(-b // cols) * per]
            elif self.dtype in ("e2m1", "q4"):
                data = self.data[:, a // 2:-(-b // 2)]
            else:
                data = self.data[:, a:b]
            data = aligned_copy(data)
            if scale is not None:
                scale = np.ascontiguousarray(scale[:, a // unit:-(-b // unit)])
        return Weight(data, self.dtype, scale=scale, block=self.block)

    @property
    def nbytes(self) -> int:
        n = self.data.shape[0] * self.data.shape[1] * self.data.itemsize
        return n + (self.scale.nbytes if self.scale is not None else 0)


def as_weight(w) -> Weight:
    """w, checked to be a Weight (CpumlaError otherwise)."""
    if not isinstance(w, Weight):
        raise CpumlaError(f"w must be a cpumla.native.Weight, got {type(w).__name__}")
    return w


def aligned_copy(a: np.ndarray, align: int = 64) -> np.ndarray:
    """A copy of a whose data starts at a multiple of `align` bytes."""
    raw = np.empty(a.nbytes + align, np.uint8)
    off = (-raw.ctypes.data) % align
    out = raw[off:off + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    return out
