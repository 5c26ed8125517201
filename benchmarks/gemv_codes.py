"""GEMV speed by weight code distribution, for A/B runs of two builds of cpumla.

Uses only the long-standing Python API (native.Weight, native.gemv, native.init), so the same script
times an older build: run it with PYTHONPATH pointing at each build's tree, alternately, and compare
the ratios. `cpumla bench --kernels --codes random,subnormal,zero` reports the same figures for the
build it belongs to.

    PYTHONPATH=. python3 benchmarks/gemv_codes.py --isa avx2,avx512 --formats e4m3,e2m1 --reps 3

Prints one JSON line per (implementation, format, codes): microseconds per call (median over passes,
each pass cycling over enough weight copies to stream from memory; or, with --best-of, the best of
that many timings of one weight in cache) and GB/s of weight bytes read.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from cpumla import native

CODES = {
    "e4m3": {"random": np.array([c for c in range(256) if c & 0x7F != 0x7F], np.uint8),
             "subnormal": np.array([m | s for m in range(1, 8) for s in (0, 0x80)], np.uint8),
             "zero": np.array([0], np.uint8)},
    "e2m1": {"random": np.arange(16, dtype=np.uint8), "subnormal": np.array([1, 9], np.uint8),
             "zero": np.array([0], np.uint8)},
}


def weight(fmt: str, codes: str, rows: int, cols: int, rng: np.random.Generator) -> native.Weight:
    q = CODES[fmt][codes][rng.integers(0, len(CODES[fmt][codes]), size=(rows, cols))]
    if fmt == "e4m3":
        grid = (-(-rows // 128), -(-cols // 128))
        return native.Weight(q, "e4m3", rng.uniform(1e-3, 1e-2, size=grid).astype(np.float32))
    packed = (q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8)
    return native.Weight(packed, "e2m1", rng.integers(118, 124, size=(rows, cols // 32)).astype(np.uint8))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--isa", default="")
    ap.add_argument("--formats", default="e4m3,e2m1")
    ap.add_argument("--codes", default="random,subnormal,zero")
    ap.add_argument("--rows", type=int, default=10944)
    ap.add_argument("--cols", type=int, default=2048)
    ap.add_argument("--stream-mb", type=int, default=256)
    ap.add_argument("--seconds", type=float, default=0.5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--best-of", type=int, default=0, help="in-cache mode: the best of this many timings of "
                    "--calls calls (use with --stream-mb 0 and a small --rows)")
    ap.add_argument("--calls", type=int, default=20)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    x = rng.standard_normal(a.cols).astype(np.float32)
    y = np.empty(a.rows, np.float32)
    isas = [i for i in a.isa.split(",") if i] or [""]
    for fmt in a.formats.split(","):
        for codes in a.codes.split(","):
            first = weight(fmt, codes, a.rows, a.cols, rng)
            copies = [first] + [weight(fmt, codes, a.rows, a.cols, rng)
                                for _ in range(max(0, (a.stream_mb << 20) // first.nbytes))]

            def one_pass():
                for w in copies:
                    native.gemv(w, x, y)

            for isa in isas:
                native.init(isa)
                native.set_threads(a.threads)
                one_pass()
                if a.best_of:
                    best = float("inf")
                    for _ in range(a.best_of):
                        t0 = time.perf_counter()
                        for _ in range(a.calls):
                            one_pass()
                        best = min(best, (time.perf_counter() - t0) / a.calls)
                    sec = best / len(copies)
                else:
                    times, start = [], time.perf_counter()
                    while len(times) < 3 or time.perf_counter() - start < a.seconds:
                        t0 = time.perf_counter()
                        one_pass()
                        times.append(time.perf_counter() - t0)
                    sec = float(np.median(times)) / len(copies)
                print(json.dumps({"isa": native.isa(), "format": fmt, "codes": codes, "us": sec * 1e6,
                                  "gbs": first.nbytes / sec / 1e9}), flush=True)


if __name__ == "__main__":
    main()
