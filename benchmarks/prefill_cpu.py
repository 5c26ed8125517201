"""Prefill efficiency on one thread, timed by the thread's CPU time, so that other work on a shared
host (which takes the core away, not cycles from a running thread) moves it little.

    python3 benchmarks/prefill_cpu.py gemm [--formats bf16,e4m3] [--shapes 512x2048x2048,48x1408x2048]
    python3 benchmarks/prefill_cpu.py model [--dtype bf16] [--depths 0,2048]
    python3 benchmarks/prefill_cpu.py crossover [--dtype bf16] [--depths 512,2048] [--chunks 64,96,128,192]

gemm: GFLOP/s of cpumla_gemm for tokens x rows x cols shapes; model: pp512 of DeepSeek-V2-Lite with
dummy weights and 4 layers at each depth (the FLOPs cpumla bench counts); crossover: the forward of a
chunk of n tokens at each depth with MLA attention absorbed, then un-absorbed (the model's
mha_min_tokens forced either way), as the ratio of their CPU times. gemm and model as % of the fp32 FMA
probe of the same process, also timed by CPU time: the best of several passes each, since other
tenants only ever slow a pass down (through the shared caches and memory). The implementation is
$CPUMLA_ISA's, as for every cpumla command.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import cpumla
from cpumla import native
from cpumla.bench import kernels as kb
from cpumla.bench import model as mb


def fma_peak() -> float:
    best = 0.0
    for _ in range(5):
        t0 = time.thread_time()
        flops = native.lib.cpumla_fma_probe(1 << 22)
        best = max(best, flops / (time.thread_time() - t0) / 1e9)
    return best


def best_cpu_seconds(fn, passes: int = 5, min_seconds: float = 0.3) -> float:
    fn()
    times, start = [], time.thread_time()
    while len(times) < passes or time.thread_time() - start < min_seconds:
        t0 = time.thread_time()
        fn()
        times.append(time.thread_time() - t0)
    return min(times)


def gemm(formats: list[str], shapes: list[tuple[int, int, int]]) -> None:
    rng = np.random.default_rng(0)
    for fmt in formats:
        for n, rows, cols in shapes:
            w = kb.random_weight(fmt, rows, cols, rng)
            x = rng.standard_normal((n, cols), dtype=np.float32)
            y = np.empty((n, rows), np.float32)
            peak = fma_peak()
            sec = best_cpu_seconds(lambda: native.gemm(w, x, y))
            peak = max(peak, fma_peak())
            pct = 100.0 * 2.0 * n * rows * cols / sec / 1e9 / peak
            print(f"{native.isa():8s} gemm {fmt:5s} {n}x{cols} @ {rows}x{cols}: {pct:5.1f}% of the FMA peak", flush=True)


def model(dtype: str, depths: list[int], n: int = 512) -> None:
    eng = cpumla.load("deepseek-ai/DeepSeek-V2-Lite", dummy_weights=True, hf_overrides={"num_hidden_layers": 4},
                      seed=0, max_seq_len=max(depths) + n + 64, dummy_dtype=dtype)
    rng = np.random.default_rng(0)
    context = rng.integers(0, eng.config.vocab_size, size=max(depths) + 1)
    for d in depths:
        times = []
        for _ in range(3):
            eng.truncate(0)
            if d:
                eng.forward(context[:d], last_only=True)
            ids = rng.integers(0, eng.config.vocab_size, size=n)
            t0 = time.thread_time()
            eng.forward(ids, last_only=True)
            times.append(time.thread_time() - t0)
        sec = min(times)
        pct = 100.0 * mb.prefill_flops(eng, n, d) / sec / 1e9 / fma_peak()
        print(f"{native.isa():8s} {dtype} pp{n} @ d{d}: {pct:5.1f}% of the FMA peak, {n / sec:.1f} t/s of CPU time",
              flush=True)


def crossover(dtype: str, depths: list[int], chunks: list[int]) -> None:
    eng = cpumla.load("deepseek-ai/DeepSeek-V2-Lite", dummy_weights=True, hf_overrides={"num_hidden_layers": 4},
                      seed=0, max_seq_len=max(depths) + max(chunks) + 64, dummy_dtype=dtype)
    ids = np.random.default_rng(0).integers(0, eng.config.vocab_size, size=max(depths) + max(chunks))
    eng.forward(ids, last_only=True)                 # every cache row written
    m, out = eng.model, np.empty((1, eng.config.vocab_size), np.float32)

    def run(n: int, d: int, min_tokens: int) -> float:
        m.mha_min_tokens = min_tokens
        return best_cpu_seconds(lambda: m.forward(ids[d:d + n], d, out, True), passes=3, min_seconds=0)

    for d in depths:
        ratios = [f"n {n}: {run(n, d, 1 << 40) / run(n, d, 2):.2f}" for n in chunks]
        print(f"{native.isa():8s} {dtype} d{d}: absorbed / un-absorbed CPU time, " + ", ".join(ratios), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=("gemm", "model", "crossover"))
    ap.add_argument("--formats", default="bf16,e4m3")
    ap.add_argument("--shapes", default="128x2048x2048,512x2048x2048,512x10944x2048,512x2048x10944,48x1408x2048,"
                                        "16x1408x2048", help="tokens x rows x cols, comma-separated")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp8"))
    ap.add_argument("--depths", default="0,2048")
    ap.add_argument("--chunks", default="64,96,128,192", help="crossover: chunk sizes")
    a = ap.parse_args()
    native.init()
    native.set_threads(1)
    if a.what == "gemm":
        gemm(a.formats.split(","), [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")])
    elif a.what == "model":
        model(a.dtype, [int(d) for d in a.depths.split(",")])
    else:
        crossover(a.dtype, [int(d) for d in a.depths.split(",")], [int(n) for n in a.chunks.split(",")])


if __name__ == "__main__":
    main()
