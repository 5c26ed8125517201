"""The kernel library's sampler (cpumla_sample): one token from a logits row by the definition in
cpumla.sampling's docstring, and the work buffer it needs. Single-threaded, no library lock: a
caller keeps its own work (one per Sampler) and may call from any thread."""

from __future__ import annotations

import numpy as np

from cpumla.errors import CpumlaError
from cpumla.native.library import ffi, last_error, lib


def work(n: int) -> np.ndarray:
    """A work buffer for rows of n logits."""
    return np.empty(int(lib.cpumla_sample_work_bytes(n)), np.uint8)


def sample(x: np.ndarray, temperature: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
           draw: int = 0, work_buf: np.ndarray | None = None) -> int:
    """The token chosen from the logits row x (float32, contiguous) by the uniform draw / 2^53
    (draw < 2^53; unused when temperature is 0). work_buf: from work(x.size), or None for a new one."""
    x = np.ascontiguousarray(x, np.float32).reshape(-1)
    n = x.size
    if work_buf is None or work_buf.nbytes < lib.cpumla_sample_work_bytes(n):
        work_buf = work(n)
    tok = lib.cpumla_sample(ffi.from_buffer("float[]", x), n, temperature, min(int(top_k), n), top_p, min_p,
                            draw, ffi.from_buffer(work_buf))
    if tok < 0:
        raise CpumlaError(last_error())
    return int(tok)


def probs(x: np.ndarray, temperature: float) -> np.ndarray:
    """The definition's p for the logits row x (temperature > 0), as the native sampler computes it."""
    x = np.ascontiguousarray(x, np.float32).reshape(-1)
    p = np.empty_like(x)
    if lib.cpumla_sample_probs(ffi.from_buffer("float[]", x), x.size, temperature,
                               ffi.from_buffer("float[]", p)) != 0:
        raise CpumlaError(last_error())
    return p
