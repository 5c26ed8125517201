"""How tensor-parallel ranks talk (runtime/tp.py starts them): ShmComm, the shared-memory communicator
of the ranks of one machine (tp_shm.c: a region every rank maps, each operation a barrier), and
GlooComm, torch.distributed's gloo collectives for ranks on several machines. Both give the native
forward a cpumla_comm (`c`: all-reduce of the partial sums, gather of the logits on rank 0) and the
runtime broadcast (rank 0's commands to the others), all_reduce (the latency probe), stats and fail."""

from __future__ import annotations

import mmap
import os

import numpy as np

from cpumla.errors import CpumlaError
from cpumla.native.library import check, ffi, last_error, lib

SLOT_BYTES = 4 << 20      # an operation's data per rank per piece (larger data goes in pieces)


def _bytes_of(buf: np.ndarray):
    return ffi.from_buffer("char[]", buf, require_writable=True)


class ShmComm:
    """Rank `rank` of `world` on the region in file `path` (every rank maps it; made by create())."""

    def __init__(self, path: str, rank: int, world: int, timeout: float):
        size = lib.cpumla_shm_bytes(world, SLOT_BYTES)
        fd = os.open(path, os.O_RDWR)
        try:
            if os.fstat(fd).st_size != size:
                raise CpumlaError(f"tensor parallel: the shared region {path} is not {size} bytes")
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._base = ffi.from_buffer("char[]", self._map)
        s = lib.cpumla_shm_new(self._base, rank, world, SLOT_BYTES, float(timeout))
        if s == ffi.NULL:
            raise CpumlaError(last_error())
        self._s = ffi.gc(s, lib.cpumla_shm_free)
        self.c = ffi.new("cpumla_comm *")
        lib.cpumla_shm_comm(self._s, self.c)
        self.rank, self.world = rank, world

    @staticmethod
    def create(world: int, directory: str | None = None) -> str:
        """A new zero-filled region for `world` ranks in a file under /dev/shm (or `directory`): its
        path. Rank 0 makes it, every rank maps it, rank 0 removes the name once all have."""
        d = directory or ("/dev/shm" if os.path.isdir("/dev/shm") else None)
        import tempfile

        fd, path = tempfile.mkstemp(prefix="cpumla-tp-", dir=d)
        try:
            os.ftruncate(fd, lib.cpumla_shm_bytes(world, SLOT_BYTES))
        finally:
            os.close(fd)
        return path

    def broadcast(self, buf: np.ndarray, command: bool = False) -> None:
        """buf's bytes from rank 0 into every rank's buf (same size on every rank). command: rank 0's
        next command, which the others wait for without a time limit."""
        check(lib.cpumla_shm_broadcast(self._s, _bytes_of(buf), buf.nbytes, int(command and self.rank != 0)))

    def all_reduce(self, buf: np.ndarray) -> None:
        """buf (float32) summed over the ranks, in place."""
        check(lib.cpumla_shm_all_reduce(self._s, ffi.from_buffer("float[]", buf, require_writable=True), buf.size))

    def gather(self, buf: np.ndarray, col0: int, cols: int) -> None:
        """buf [rows, ld] float32 holds this rank's columns col0 .. col0+cols; rank 0's gets every rank's."""
        check(lib.cpumla_shm_gather(self._s, ffi.from_buffer("float[]", buf, require_writable=True), buf.shape[0],
                                          buf.shape[1], col0, cols))

    def stats(self) -> dict:
        st = ffi.new("cpumla_comm_stats *")
        lib.cpumla_shm_get_stats(self._s, st)
        return {"all_reduces": st.all_reduces, "gathers": st.gathers, "broadcasts": st.broadcasts,
                "seconds": st.seconds}

    def reset_stats(self) -> None:
        lib.cpumla_shm_reset_stats(self._s)

    def fail(self) -> None:
        """Tells the other ranks this one stops: their next wait ends with an error naming it."""
        lib.cpumla_shm_fail(self._s)

    def close(self) -> None:
        self._s = None


class GlooComm:
    """The ranks of torch.distributed's default (gloo) group, through two groups of them: `ops`, whose
    collectives fail after the ranks' time limit, and `commands`, without one (the wait for rank 0's
    next command)."""

    def __init__(self, commands, ops):
        import time

        import torch
        import torch.distributed as dist

        self._dist, self._torch, self._time, self._commands, self._ops = dist, torch, time, commands, ops
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.reset_stats()
        self.error = None
        self._cb_reduce = ffi.callback("int(void *, float *, int64_t)", self._c_all_reduce)
        self._cb_gather = ffi.callback("int(void *, float *, int64_t, int64_t, int64_t, int64_t)", self._c_gather)
        self.c = ffi.new("cpumla_comm *")
        self.c.rank, self.c.world = self.rank, self.world
        self.c.all_reduce, self.c.gather = self._cb_reduce, self._cb_gather

    def _tensor(self, ptr, n):
        return self._torch.from_numpy(np.frombuffer(ffi.buffer(ptr, 4 * n), np.float32))

    def _timed(self, key, fn):
        t = self._time.perf_counter()
        try:
            fn()
            return 0
        except Exception as e:   # noqa: BLE001 (a callback from C: the error goes back as -1)
            self.error = f"tensor parallel (gloo): {str(e).splitlines()[0] if str(e) else type(e).__name__}"
            return -1
        finally:
            self._stats[key] += 1
            self._stats["seconds"] += self._time.perf_counter() - t

    def _c_all_reduce(self, ctx, buf, n):
        return self._timed("all_reduces", lambda: self._dist.all_reduce(self._tensor(buf, n), group=self._ops))

    def _c_gather(self, ctx, buf, rows, ld, col0, cols):
        def run():
            torch = self._torch
            full = np.frombuffer(ffi.buffer(buf, 4 * rows * ld), np.float32).reshape(rows, ld)
            width = self._max_cols(ld)
            mine = torch.zeros(rows, width + 2)
            mine[:, 0], mine[:, 1] = float(col0), float(cols)       # exact: a vocabulary is < 2^24
            mine[:, 2:2 + cols] = torch.from_numpy(full[:, col0:col0 + cols])
            parts = [torch.empty_like(mine) for _ in range(self.world)] if self.rank == 0 else None
            self._dist.gather(mine, parts, dst=0, group=self._ops)
            if self.rank == 0:
                for p in parts[1:]:
                    c0, c = int(p[0, 0]), int(p[0, 1])
                    full[:, c0:c0 + c] = p[:, 2:2 + c].numpy()
        return self._timed("gathers", run)

    def _max_cols(self, ld: int) -> int:
        return -(-ld // self.world) + 256       # any rank's slice of a row (vocab_rows: whole blocks)

    def broadcast(self, buf: np.ndarray, command: bool = False) -> None:
        t = self._time.perf_counter()
        try:
            flat = buf.reshape(-1).view(np.uint8)
            self._dist.broadcast(self._torch.from_numpy(flat), src=0, group=self._commands if command else self._ops)
        except Exception as e:   # noqa: BLE001 (a peer gone: one line)
            raise CpumlaError(f"tensor parallel (gloo): {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
        self._stats["broadcasts"] += 1
        self._stats["seconds"] += self._time.perf_counter() - t

    def all_reduce(self, buf: np.ndarray) -> None:
        if self._c_all_reduce(None, ffi.from_buffer("float[]", buf, require_writable=True), buf.size) != 0:
            raise CpumlaError(self.error)

    def stats(self) -> dict:
        return dict(self._stats)

    def reset_stats(self) -> None:
        self._stats = dict.fromkeys(("all_reduces", "gathers", "broadcasts"), 0) | {"seconds": 0.0}

    def fail(self) -> None:
        pass              # gloo tells the others when this process exits

    def close(self) -> None:
        pass
