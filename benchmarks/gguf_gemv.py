"""GGUF block types' gemv (and gemm) speed next to cpumla's own q4 / q8 and GGUF's Q8_0, in one run.

Random blocks with normal scales (gguf_weight of cpumla/bench/kernels.py: the speed does not depend on
the values), one weight in cache (--cache-mb) and one out of cache (--big-mb) per format. Prints GB/s of weight bytes read per second
(best of --reps) and the ratio to cpumla's own q4 at the same size; ratios are the numbers to compare
across runs (absolute speeds drift on a shared host).

    python3 benchmarks/gguf_gemv.py q4_k q6_k q2_k [--isa avx2] [--tokens 1 8] [--threads 2]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cpumla import native  # noqa: E402
from cpumla.bench.kernels import gguf_weight  # noqa: E402

def own_weight(fmt: str, rows: int, cols: int, rng) -> native.Weight:
    if fmt == "q8":
        data = rng.integers(-127, 128, (rows, cols), dtype=np.int8)
    else:
        data = rng.integers(0, 256, (rows, cols // 2), dtype=np.uint8)
    scale = (rng.uniform(0.2, 1.0, (rows, cols // 32)) * 1e-2).astype(np.float16)
    return native.Weight(data, fmt, scale, (1, 32))


def weight_bytes(w: native.Weight) -> int:
    return w.data.nbytes + (w.scale.nbytes if w.scale is not None else 0)


def bytes_per_row(fmt: str, cols: int) -> float:
    if fmt in native.GGUF_FORMATS:
        block, per = native.GGUF_FORMATS[fmt]
        return cols // block * per
    return cols * (1 if fmt == "q8" else 0.5) + cols // 32 * 2


def seconds(w: native.Weight, n: int, cols: int, reps: int, min_s: float) -> float:
    x = np.random.default_rng(1).standard_normal((n, cols)).astype(np.float32)
    y = np.empty((n, w.rows), np.float32)
    call = (lambda: native.gemv(w, x[0], y[0])) if n == 1 else (lambda: native.gemm(w, x, y))
    call()
    t0, k = time.perf_counter(), 1
    call()
    one = time.perf_counter() - t0
    k = max(1, int(min_s / max(one, 1e-6)))
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(k):
            call()
        best = min(best, (time.perf_counter() - t0) / k)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("types", nargs="*", default=["q4_k", "q6_k", "q5_k", "q3_k", "q2_k"])
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--cache-mb", type=float, default=1.0, help="weight size in cache (MB)")
    ap.add_argument("--big-mb", type=float, default=256.0, help="weight size out of cache (MB); 0: skip")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1], help="n: 1 is the gemv, more a gemm")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--min-s", type=float, default=0.05, help="seconds a rep lasts at least")
    ap.add_argument("--isa", default=None)
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    isa = native.init(a.isa)
    if a.threads:
        native.set_threads(a.threads)
    rng = np.random.default_rng(0)
    fmts = ["q4", "q8", "q8_0"] + [f for f in a.types if f not in ("q4", "q8", "q8_0")]
    sizes = [("cache", a.cache_mb)] + ([("big", a.big_mb)] if a.big_mb > 0 else [])
    print(f"isa {isa}, threads {native.get_threads()}, cols {a.cols}")
    for label, mb in sizes:
        for n in a.tokens:
            print(f"-- {label} ({mb:g} MB), n = {n}: GB/s of weights (x own q4)")
            base = None
            for fmt in fmts:
                rows = max(8, int(mb * 1e6 / bytes_per_row(fmt, a.cols)) // 8 * 8)
                w = gguf_weight(fmt, rows, a.cols, rng) if fmt in native.GGUF_FORMATS else own_weight(fmt, rows, a.cols, rng)
                gbs = weight_bytes(w) * n / seconds(w, n, a.cols, a.reps, a.min_s) / 1e9 if n > 1 else \
                    weight_bytes(w) / seconds(w, n, a.cols, a.reps, a.min_s) / 1e9
                base = base or gbs
                who = native.kernel_impl(f"gemv:{fmt}" if n == 1 else f"gemm:{fmt}")
                print(f"{fmt:8s} {gbs:7.2f}  x{gbs / base:5.2f}  ({who})")
                del w


if __name__ == "__main__":
    main()
