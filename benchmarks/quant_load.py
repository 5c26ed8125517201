"""Seconds to load a checkpoint with --quant q8 / q4 and as stored, against the read probe's time for
the checkpoint's bytes and against reading its files once, both measured in the same process,
alternating builds of cpumla.

    flock /tmp/cpumla-bench.lock python3 benchmarks/quant_load.py MODEL_DIR --builds OLD,NEW [--rounds 2]

MODEL_DIR is a saved checkpoint (in the page cache: read it once first); OLD and NEW are trees each
built in place (`python3 setup.py build_ext --inplace`), put on PYTHONPATH in turn. Each round starts,
for each build, one process that maps the checkpoint's safetensors files and reads them with the read
probe (the best of three passes after one that maps the pages), then loads the model `--loads` times
in each variant (as stored, q8, q4, in turn; each model freed before the next load) and times
cpumla.load. Prints, per build and variant, the fastest load and the median over all rounds, both
also as a multiple of that process's probe time. Memory the kernel has not handed out recently can
cost far more than the work itself on a virtual machine (a hypervisor that took it back supplies it
again on first touch), so right before each load `--warm-gb` GB of memory is faulted in and freed:
the load then gets pages the kernel has just had back, as a machine with the memory to itself would.

Two baselines: the read probe streams memory that is already mapped (a lower bound no reader of a
file reaches: whoever reads the page cache first pays for the page tables, or for a copy), and the
file read reads every shard once with os.preadv on `--threads` threads, 1 MiB at a time into a buffer
per thread (as cat or dd would, in parallel; the best of three passes).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

VARIANTS = ("stored", "q8", "q4")


def child(model: str, loads: int, threads: int, warm: int) -> dict:
    import gc
    import mmap
    import time

    import numpy as np

    import cpumla
    from cpumla import native

    native.ensure_init()
    native.set_threads(threads)
    maps, total = [], 0
    for f in sorted(Path(model).glob("*.safetensors")):
        with open(f, "rb") as fh:
            m = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        a = np.frombuffer(m, np.uint8)
        maps.append(a)
        total += a.nbytes

    def probe():
        t0 = time.perf_counter()
        for a in maps:
            native.lib.cpumla_read_probe(native.ffi.cast("char *", a.ctypes.data), a.nbytes & ~63)
        return time.perf_counter() - t0

    def warm_memory():
        """Fault in and free `warm` bytes of huge-page memory, so that the load's own memory is pages
        the kernel has just had back rather than pages a hypervisor must supply again"""
        if warm <= 0:
            return
        m = mmap.mmap(-1, warm, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            m.madvise(mmap.MADV_HUGEPAGE)
        np.frombuffer(m, np.uint8)[::4096] = 1
        m.close()

    def file_read():
        import threading

        files = sorted(Path(model).glob("*.safetensors"))
        sizes = [f.stat().st_size for f in files]
        fds = [os.open(f, os.O_RDONLY) for f in files]
        bufs = [bytearray(1 << 20) for _ in range(threads)]
        spans = []                      # (fd, begin, end): each thread an equal share of every file
        for fd, n in zip(fds, sizes):
            spans += [(fd, n * i // threads, n * (i + 1) // threads) for i in range(threads)]

        def work(i):
            mv = memoryview(bufs[i])
            for fd, lo, hi in spans[i::threads]:
                while lo < hi:
                    got = os.preadv(fd, [mv[: min(len(mv), hi - lo)]], lo)
                    if got <= 0:
                        raise OSError(f"short read at {lo}")
                    lo += got

        ths = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
        t0 = time.perf_counter()
        for th in ths:
            th.start()
        for th in ths:
            th.join()
        el = time.perf_counter() - t0
        for fd in fds:
            os.close(fd)
        return el

    probe()
    probe_s = min(probe() for _ in range(3))
    read_s = min(file_read() for _ in range(3))
    times = {v: [] for v in VARIANTS}
    for _ in range(loads):
        for v in VARIANTS:
            warm_memory()
            t0 = time.perf_counter()
            eng = cpumla.load(model, quant=None if v == "stored" else v, threads=threads, max_seq_len=256)
            times[v].append(time.perf_counter() - t0)
            del eng
            gc.collect()
    return {"probe_s": probe_s, "read_s": read_s, "bytes": total, "times": times, "cpumla": cpumla.__file__}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="a checkpoint directory")
    ap.add_argument("--builds", default=".", help="comma-separated trees to put on PYTHONPATH in turn")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--loads", type=int, default=3, help="loads of each variant per process")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--warm-gb", type=float, default=3.0,
                    help="GB of memory faulted in and freed right before each load (0: none)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(child(a.model, a.loads, a.threads, int(a.warm_gb * 1e9))))
        return
    builds = [str(Path(b).resolve()) for b in a.builds.split(",")]
    runs = {b: [] for b in builds}
    for r in range(a.rounds):
        for b in builds:
            env = dict(os.environ, PYTHONPATH=b)
            out = subprocess.run([sys.executable, __file__, a.model, "--child", "--loads", str(a.loads),
                                  "--threads", str(a.threads), "--warm-gb", str(a.warm_gb)], env=env, capture_output=True, text=True, check=True)
            res = json.loads(out.stdout.strip().splitlines()[-1])
            if not res["cpumla"].startswith(b):
                sys.exit(f"{b}: the child imported cpumla from {res['cpumla']}")
            runs[b].append(res)
            print(f"round {r + 1} {b}: probe {res['probe_s']:.3f} s ({res['bytes'] / res['probe_s'] / 1e9:.1f} GB/s), "
                  f"file read {res['read_s']:.3f} s ({res['bytes'] / res['read_s'] / 1e9:.1f} GB/s); "
                  + "; ".join(f"{v} " + " ".join(f"{t:.2f}" for t in res["times"][v]) for v in VARIANTS), flush=True)
    print(f"\n{runs[builds[0]][0]['bytes'] / 1e9:.2f} GB of safetensors, {a.threads} threads; "
          "load seconds, and x the read probe / x the file read of the same process")
    print(f"{'build':<40} {'variant':<7} {'fastest':>8} {'x probe':>8} {'x read':>7} {'median':>8} {'x probe':>8} {'x read':>7}")
    for b in builds:
        for v in VARIANTS:
            rows = [(t, t / res["probe_s"], t / res["read_s"]) for res in runs[b] for t in res["times"][v]]
            best = min(rows)
            med = [statistics.median(p[i] for p in rows) for i in range(3)]
            print(f"{b[-40:]:<40} {v:<7} {best[0]:8.3f} {best[1]:8.1f} {best[2]:7.2f} {med[0]:8.3f} {med[1]:8.1f} {med[2]:7.2f}")


if __name__ == "__main__":
    main()
