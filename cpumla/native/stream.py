"""Routed experts streamed from disk (cpumla_stream, cpumla.h): expert tables whose weights stay in their
files and are read, with direct I/O, into a fixed number of slots as cpumla_moe routes to them; and the
disk probe that their read speed is measured against."""

from __future__ import annotations

from dataclasses import dataclass

from cpumla.errors import CpumlaError
from cpumla.native.library import check, ensure_init, ffi, last_error, lib
from cpumla.native.model import Experts

POLICIES = {"lru": lib.CPUMLA_STREAM_LRU, "lfu": lib.CPUMLA_STREAM_LFU}


@dataclass
class StreamStats:
    lookups: int            # experts the MoE calls asked for (each once a call)
    hits: int               # of those, found in a slot
    reads: int              # experts read from disk
    bytes_read: int
    busy_seconds: float     # time with at least one read in flight
    wait_seconds: float     # time the forward waited for reads
    prefetches: int         # experts read ahead, the next layer's router applied to this layer's input
    prefetch_used: int      # of those, the ones a call then asked for
    slots: int
    slot_bytes: int
    direct: bool            # every file read with O_DIRECT (else through the page cache)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 1.0

    @property
    def read_gbps(self) -> float:
        """GB/s of the expert reads while any was in flight."""
        return self.bytes_read / self.busy_seconds / 1e9 if self.busy_seconds > 0 else 0.0


class ExpertStream:
    """The routed expert tables of one model, read from its files into `slots` slots.

    files: (address, length, path) of each read-only mapping the tables' weights point into. Tables are
    added, then start(slots) sizes the slots; from then on cpumla_moe on an added table reads its experts
    through the stream, and the tables are kept alive until close()."""

    def __init__(self, files: list[tuple[int, int, str]], io_threads: int = 8, policy: str = "lru"):
        self._s = None
        ensure_init()
        if policy not in POLICIES:
            raise CpumlaError(f"expert cache policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        if not files:
            raise CpumlaError("an expert stream needs the files its experts are in")
        self._paths = [ffi.new("char[]", str(p).encode()) for _, _, p in files]
        c = ffi.new("cpumla_stream_file[]", len(files))
        for i, (addr, length, _) in enumerate(files):
            c[i].base, c[i].length, c[i].path = ffi.cast("void *", addr), length, self._paths[i]
        s = lib.cpumla_stream_new(c, len(files), io_threads, POLICIES[policy])
        if s == ffi.NULL:
            raise CpumlaError(last_error())
        self._s = s
        self._tables: list[Experts] = []
        self.policy = policy

    def add(self, table: Experts) -> None:
        check(lib.cpumla_stream_add(self._s, table.c, table.n))
        self._tables.append(table)

    @property
    def slot_bytes(self) -> int:
        return int(lib.cpumla_stream_slot_bytes(self._s))

    def start(self, slots: int) -> None:
        check(lib.cpumla_stream_start(self._s, slots))

    def stats(self) -> StreamStats:
        st = ffi.new("cpumla_stream_stats *")
        lib.cpumla_stream_get_stats(self._s, st)
        return StreamStats(st.lookups, st.hits, st.reads, st.bytes_read, st.busy_seconds, st.wait_seconds,
                           st.prefetches, st.prefetch_used, st.n_slots, st.slot_bytes, bool(st.direct))

    def reset_stats(self) -> None:
        lib.cpumla_stream_reset_stats(self._s)

    def close(self) -> None:
        """Stops the readers and frees the slots: the tables are read from their mappings again."""
        if self._s is not None:
            lib.cpumla_stream_free(self._s)
            self._s = None

    def __del__(self):
        try:
            self.close()
        except Exception:      # at interpreter exit the library's module may be gone already
            pass


def disk_probe(path, nbytes: int, threads: int = 8) -> tuple[float, int]:
    """(bytes per second, bytes read) of direct reads of the first nbytes of the file at path, 1 MiB
    requests with `threads` in flight, as an ExpertStream reads."""
    ensure_init()
    got = ffi.new("int64_t *")
    rate = lib.cpumla_disk_probe(str(path).encode(), nbytes, threads, got)
    if rate < 0:
        raise CpumlaError(last_error())
    return float(rate), int(got[0])
