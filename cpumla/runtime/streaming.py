"""Routed experts read from disk when a checkpoint does not fit its memory budget (`--memory`).

A model's bytes split in two: what every token reads (attention, dense and shared MLPs, routers, norms,
the embedding and the head: the resident part) and the routed experts, of which a token reads top_k a
layer. When the whole checkpoint, its caches and scratch fit the budget, the model runs as it always
has, mapped from its files. When they do not:
- the resident part is copied into the process's own memory as the model is built (ResidentSource), so
  that nothing a token reads can vanish with its file (a mapped page of a file cut short is a SIGBUS),
  and the page cache is asked to drop the files' pages;
- the routed expert tables go to an ExpertStream (native/stream.py), which reads the experts a token
  routes to, with direct I/O, into as many slots as the rest of the budget holds.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import numpy as np

from cpumla.checkpoint.formats import scale_names
from cpumla.errors import CpumlaError
from cpumla.models import PREFILL_CHUNK
from cpumla.native.stream import ExpertStream
from cpumla.runtime.memory import available_memory, gib

ROUTED = re.compile(r"(^|\.)experts\.\d+\.")    # a routed expert's tensors (HF and V4 names; shared_experts is not)
MARGIN = 512 << 20      # left out of the budget: the interpreter, the tokenizer, numpy's temporaries
IO_THREADS = 8          # expert reads in flight: what an NVMe drive needs to reach its speed with 1 MiB reads


def is_routed(name: str) -> bool:
    return ROUTED.search(name) is not None


@dataclass
class Budget:
    memory: int             # the budget: --memory, or what the process may use
    memory_from: str
    resident: int           # bytes of the weights every token reads
    routed: int             # bytes of the routed experts
    experts: int            # how many routed experts there are
    cache: int
    scratch: int

    @property
    def fits(self) -> bool:
        return self.resident + self.routed + self.cache + self.scratch + MARGIN <= self.memory

    @property
    def room(self) -> int:
        """What the expert slots may take."""
        return self.memory - MARGIN - self.resident - self.cache - self.scratch

    def holds(self, k: int) -> bool:
        """Whether the room holds k experts of the average size."""
        return self.experts > 0 and self.room >= k * -(-self.routed // self.experts)


def budget(fam, cfg, src, ctx: int, memory: int | None) -> Budget:
    """The split of a checkpoint's bytes (from its headers: nothing is read) against the budget."""
    resident = routed = weights = 0
    stored = getattr(fam, "stored_name", lambda s, n: n if s.has(n) else None)
    for name in fam.tensors(cfg):
        name = stored(src, name)
        if name is None:
            continue
        b = src.tensor_nbytes(name) + sum(src.tensor_nbytes(s) for s in scale_names(name) if src.has(s))
        if is_routed(name):
            routed += b
            weights += 1
        else:
            resident += b
    mem = fam.memory_bytes(cfg, ctx, "bf16", PREFILL_CHUNK)
    if memory is None:
        memory, what = available_memory()
    else:
        what = "--memory"
    return Budget(memory, what, resident, routed, weights // 3, mem["cache"], mem["scratch"])


class ResidentSource:
    """A checkpoint whose tensors other than the routed experts are copied into memory when read."""

    def __init__(self, src):
        self._src = src

    def __getattr__(self, name):
        return getattr(self._src, name)

    def tensor(self, name: str) -> np.ndarray:
        a = self._src.tensor(name)
        return a if is_routed(name) else np.array(a)


def drop_page_cache(files) -> None:
    """Unmaps the pages of the mappings (address, length, path) that building the model read, and asks
    the kernel to drop the files' cached pages: the resident part has its copy now, and a mapped page
    would count against the budget (RSS) for as long as the model lives."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    for addr, length, _ in files:
        libc.madvise(addr, length, 4)                     # MADV_DONTNEED: the pages read back on use
    for _, _, p in files:
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except (OSError, AttributeError):
            pass
        finally:
            os.close(fd)


def start(model, src, b: Budget, top_k: int, where: str, slots: int | None = None,
          policy: str = "lru") -> ExpertStream:
    """The stream over `model`'s routed expert tables (model.routed_tables()), with as many slots as
    b.room holds (or `slots`). CpumlaError when that is fewer than a token's top_k experts."""
    tables = model.routed_tables()
    files = src.mappings()
    s = ExpertStream(files, IO_THREADS, policy)
    try:
        for t in tables:
            s.add(t)
        per = s.slot_bytes
        n = slots if slots is not None else max(0, b.room) // max(per, 1)
        total = sum(t.n for t in tables)
        n = min(n, total)
        if n < top_k:
            raise CpumlaError(
                f"{where}: {gib(b.memory)} of memory ({b.memory_from}) holds the resident part (weights "
                f"{gib(b.resident)}, caches {gib(b.cache)}, scratch {gib(b.scratch)}) and {max(n, 0)} routed experts "
                f"of {gib(per)}, fewer than the {top_k} a token uses: give it at least "
                f"{gib(b.memory - b.room + top_k * per)}")
        drop_page_cache(files)     # before the slots take the memory it held
        s.start(n)
    except BaseException:
        s.close()
        raise
    return s
