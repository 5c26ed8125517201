"""Microseconds to choose one token from a 129,280-logit row (DeepSeek's vocabulary): the native sampler
(cpumla.native.sample, what Sampler.choose runs) against the numpy path (sampling.sample_numpy, the
same definition), on flat rows (dummy random weights give nearly flat logits), equal logits, a
normal and a peaked row, with the sampling settings of everyday chat.

    PYTHONPATH=. python3 benchmarks/sampling.py [--isa avx2,avx512] [--reps 20]

Prints one JSON line per (implementation, row, settings): us per token (best of --reps timings of
--inner calls each, so a busy machine shows less), and native / numpy. One core: the sampler is
single-threaded.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from cpumla import native, sampling
from cpumla.native import sample as native_sample

N = 129280
SETTINGS = {"t0.8": dict(), "t0.8 top_p 0.95": dict(top_p=0.95), "t0.8 top_k 40": dict(top_k=40),
            "t0.8 top_p 0.95 min_p 0.05": dict(top_p=0.95, min_p=0.05)}


def rows(rng: np.random.Generator) -> dict[str, np.ndarray]:
    peaked = (rng.standard_normal(N) * 3).astype(np.float32)
    peaked[5] = 40
    return {"flat (std 0.001)": (rng.standard_normal(N) * 0.001).astype(np.float32),
            "flat (std 0.05)": (rng.standard_normal(N) * 0.05).astype(np.float32),
            "equal": np.zeros(N, np.float32),
            "normal (std 8)": (rng.standard_normal(N) * 8).astype(np.float32),
            "peaked": peaked}


def best_us(fn, reps: int, inner: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(inner):
            fn()
        best = min(best, (time.perf_counter() - t) / inner)
    return best * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--isa", default="", help="comma-separated implementations (default: the best here)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--inner", type=int, default=20)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    data = rows(rng)
    draws = [int(d) for d in rng.integers(0, 1 << 53, 64)]
    work = native_sample.work(N)
    for isa in [i for i in args.isa.split(",") if i] or [""]:
        isa = native.init(isa)
        for row_name, x in data.items():
            for name, kw in SETTINGS.items():
                it = iter(draws * (args.reps * args.inner + 1))
                nat = best_us(lambda: native_sample.sample(x, 0.8, draw=next(it), work_buf=work, **kw),
                              args.reps, args.inner)
                it = iter(draws * (args.reps * args.inner + 1))
                ref = best_us(lambda: sampling.sample_numpy(x, 0.8, draw=next(it), **kw), max(3, args.reps // 4),
                              max(2, args.inner // 4))
                print(json.dumps({"isa": isa, "row": row_name, "settings": name, "native_us": round(nat, 1),
                                  "numpy_us": round(ref, 1), "native/numpy": round(nat / ref, 3)}), flush=True)


if __name__ == "__main__":
    main()
