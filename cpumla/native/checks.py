"""Argument checks for the kernel wrappers in cpumla/native/__init__.py: the C kernels trust their
arguments, so every public Python entry point checks types, dtypes, shapes, strides and writability
first and raises CpumlaError (one line) for anything the kernel could not take safely."""

from __future__ import annotations

import numbers

import numpy as np

from cpumla.errors import CpumlaError

I64_MAX = 2**63 - 1
I32_MAX = 2**31 - 1


def integer(v, name: str, lo: int = 0, hi: int = I64_MAX) -> int:
    """v as a Python int in [lo, hi]: Python or numpy integers only (no bool, float or string)."""
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise CpumlaError(f"{name} must be an integer, got {type(v).__name__}")
    v = int(v)
    if not lo <= v <= hi:
        raise CpumlaError(f"{name} is {v}, outside [{lo}, {hi}]")
    return v


def real(v, name: str) -> float:
    """v as a float (Python or numpy real numbers; NaN and inf pass: the kernels propagate them)."""
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise CpumlaError(f"{name} must be a number, got {type(v).__name__}")
    return float(v)


def array(a, name: str, dtypes, ndim: int, shape=None, writable: bool = False) -> np.ndarray:
    """Checks a kernel buffer: a numpy array of one of `dtypes` with `ndim` dimensions, the given shape
    (None entries: any), a contiguous last axis and outer strides that are non-negative whole
    multiples of the element size (rows of a strided view are fine), writable when asked."""
    if not isinstance(a, np.ndarray):
        raise CpumlaError(f"{name} must be a numpy array, got {type(a).__name__}")
    dtypes = tuple(np.dtype(d) for d in (dtypes if isinstance(dtypes, (tuple, list)) else (dtypes,)))
    if a.dtype not in dtypes:
        raise CpumlaError(f"{name} must be {' or '.join(str(d) for d in dtypes)}, got {a.dtype}")
    if a.ndim != ndim:
        raise CpumlaError(f"{name} must be {ndim}-D, got shape {tuple(a.shape)}")
    if shape is not None:
        for axis, (got, want) in enumerate(zip(a.shape, shape)):
            if want is not None and got != want:
                want_s = tuple("n" if w is None else w for w in shape)
                raise CpumlaError(f"{name} has shape {tuple(a.shape)}, want {want_s}")
    if a.size:
        item = a.itemsize
        if a.shape[-1] > 1 and a.strides[-1] != item:
            raise CpumlaError(f"{name} must have a contiguous last dimension")
        for axis in range(ndim - 1):
            st = a.strides[axis]
            if a.shape[axis] > 1 and (st < 0 or st % item):
                raise CpumlaError(f"{name} has stride {st} bytes on axis {axis}: strides must be "
                                  f"non-negative multiples of its {item}-byte elements")
    if writable and not a.flags.writeable:
        raise CpumlaError(f"{name} must be writable")
    return a


def ld(a: np.ndarray, axis: int = 0) -> int:
    """Stride of axis in elements (a size-1 axis may have any numpy stride: report a packed one)."""
    if a.shape[axis] <= 1:
        return int(np.prod(a.shape[axis + 1:], dtype=np.int64)) if axis + 1 < a.ndim else 1
    return a.strides[axis] // a.itemsize
