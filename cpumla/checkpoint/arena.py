"""Memory in 2 MiB transparent huge pages for the tensors a forward streams every token (dummy weights,
quantized weights): a GEMV streaming GBs per token walks 512x fewer pages, and the hardware
prefetchers, which stop at page boundaries, run on."""

from __future__ import annotations

import mmap

import numpy as np

HUGE = 2 << 20
ARENA = 256 << 20


class HugeArena:
    """Bump allocator over 256 MiB anonymous mappings backed by 2 MiB transparent huge pages (Linux, THP
    in madvise mode). A GEMV streaming GBs per token then walks 512x fewer pages and the hardware
    prefetchers, which stop at page boundaries, run on. Tensors
    sit back to back, so the huge pages waste nothing per tensor; the untouched tail of a mapping is
    never resident. Tensors under 2 MiB are packed in blocks of their own, so that a long-lived small one
    (a norm, a scale grid) never keeps alive the block of a large one that goes away (Quantizer: a
    weight's source once it is quantized)."""

    def __init__(self, small_apart: bool = True):
        self.raw, self.off = None, 0
        self.small = HugeArena(small_apart=False) if small_apart else None    # tensors under 2 MiB

    def _map(self, size: int) -> np.ndarray:
        m = mmap.mmap(-1, size + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        try:
            m.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass
        raw = np.frombuffer(m, dtype=np.uint8)       # arrays made from it keep the mapping alive
        return raw[(-raw.ctypes.data) % HUGE:]

    def empty(self, shape, dtype, small: bool = False) -> np.ndarray:
        """An uninitialised array; under 2 MiB a plain numpy one unless `small` (then packed in the arena)."""
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        if (n < HUGE and not small) or not hasattr(mmap, "MADV_HUGEPAGE"):
            return np.empty(shape, dtype)
        if n > ARENA // 4:                            # big tensors get a mapping of their own
            raw = self._map((n + HUGE - 1) & ~(HUGE - 1))
            return raw[:n].view(dtype).reshape(shape)
        if n < HUGE and self.small is not None:
            return self.small.empty(shape, dtype, small=True)
        if self.raw is None or self.off + n > ARENA:
            self.raw, self.off = self._map(ARENA), 0
        a = self.raw[self.off:self.off + n].view(dtype).reshape(shape)
        self.off = (self.off + n + 63) & ~63
        return a


_ARENA = HugeArena()            # the process's shared arena: dummy weights, benchmarks' buffers
hugepage_empty = _ARENA.empty


def drop_current_block() -> None:
    """Lets the shared arena's current block go once the arrays in it die, rather than stay resident
    as the block new tensors are cut from (a quantized weight's source, once it is quantized)."""
    _ARENA.raw = None


def in_arena(a: np.ndarray) -> np.ndarray:
    """a copied into the huge-page arena: V4's release-format dummies (FP4 codes, E8M0 scale grids, fp32
    matrices such as the mHC weights), which the forward streams every token, sit in huge pages as the
    linear weights of 2 MiB and more do (random_normal, random_e4m3): on 4 KiB pages they read slower."""
    out = hugepage_empty(a.shape, a.dtype, small=True)
    np.copyto(out, a)
    return out
