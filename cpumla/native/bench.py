"""Kernel micro-benchmark: GB/s of each GEMV weight format next to a read-bandwidth probe measured in
the same run (the probe is what decode is bound by), and prefill GEMM GFLOP/s.

Each measurement cycles over enough copies of the weight that they cannot stay in the last-level
cache, so every pass streams from memory as a real model's decode does.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import numpy as np

from cpumla import native

STREAM_BYTES = 512 << 20        # copies of a weight add up to at least this much
FORMATS = ("f32", "bf16", "f16", "e4m3", "e4m3-e8m0", "e2m1", "q8", "q4")


@dataclass
class KernelResult:
    kernel: str
    format: str
    shape: str
    threads: int
    isa: str
    seconds: float           # per call, median of passes
    gbs: float               # weight (+ scale) bytes read per second; GEMM: 0
    pct_probe: float         # gbs / probe GB/s * 100
    gflops: float


def random_weight(fmt: str, rows: int, cols: int, rng: np.random.Generator) -> native.Weight:
    if fmt == "f32":
        return native.Weight(rng.standard_normal((rows, cols), dtype=np.float32), "f32")
    if fmt == "f16":
        return native.Weight(rng.standard_normal((rows, cols), dtype=np.float32).astype(np.float16), "f16")
    if fmt == "bf16":
        bits = rng.standard_normal((rows, cols), dtype=np.float32).view(np.uint32) >> 16
        return native.Weight(bits.astype(np.uint16), "bf16")
    if fmt.startswith("e4m3"):
        q = rng.integers(0, 256, size=(rows, cols), dtype=np.uint8)
        q[(q & 0x7F) == 0x7F] &= 0xF7            # no NaN codes
        grid = (-(-rows // 128), -(-cols // 128))
        if fmt == "e4m3-e8m0":
            scale = rng.integers(118, 124, size=grid, dtype=np.uint8)
        else:
            scale = rng.uniform(1e-3, 1e-2, size=grid).astype(np.float32)
        return native.Weight(q, "e4m3", scale)
    if fmt == "e2m1":
        q = rng.integers(0, 256, size=(rows, cols // 2), dtype=np.uint8)
        scale = rng.integers(118, 124, size=(rows, cols // 32), dtype=np.uint8)
        return native.Weight(q, "e2m1", scale)
    if fmt in native.QUANT_FORMATS:
        scale = rng.uniform(1e-3, 1e-2, size=(rows, cols // 32)).astype(np.float16)
        if fmt == "q8":
            return native.Weight(rng.integers(-127, 128, size=(rows, cols), dtype=np.int8), "q8", scale)
        return native.Weight(rng.integers(0, 256, size=(rows, cols // 2), dtype=np.uint8), "q4", scale)
    raise ValueError(fmt)


def _time_passes(fn, min_seconds: float) -> float:
    """Median seconds of one pass of fn() after a warm-up pass."""
    fn()
    times = []
    start = time.perf_counter()
    while len(times) < 3 or (time.perf_counter() - start < min_seconds and len(times) < 200):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def read_bandwidth(min_seconds: float = 1.0, nbytes: int = STREAM_BYTES * 2) -> float:
    """GB/s of the read probe over a buffer far larger than any cache."""
    buf = native.aligned_copy(np.ones(nbytes // 8, np.float64))   # the probe's loads are 64-byte aligned
    sec = _time_passes(lambda: native.read_probe(buf), min_seconds)
    return buf.nbytes / sec / 1e9


def gemv_bandwidth(fmt: str, rows: int, cols: int, min_seconds: float, probe_gbs: float,
                   rng: np.random.Generator, stream_bytes: int = STREAM_BYTES) -> KernelResult:
    first = random_weight(fmt, rows, cols, rng)
    copies = [first] + [random_weight(fmt, rows, cols, rng)
                        for _ in range(max(0, -(-stream_bytes // first.nbytes) - 1))]
    x = rng.standard_normal(cols, dtype=np.float32)
    y = np.empty(rows, np.float32)

    def one_pass():
        for w in copies:
            native.gemv(w, x, y)

    sec = _time_passes(one_pass, min_seconds) / len(copies)
    gbs = first.nbytes / sec / 1e9
    return KernelResult("gemv", fmt, f"{rows}x{cols}", native.get_threads(), native.kernel_impl(f"gemv:{fmt}"),
                        sec, gbs, 100.0 * gbs / probe_gbs, 2.0 * rows * cols / sec / 1e9)


def gemm_throughput(fmt: str, rows: int, cols: int, n: int, min_seconds: float,
                    rng: np.random.Generator) -> KernelResult:
    w = random_weight(fmt, rows, cols, rng)
    x = rng.standard_normal((n, cols), dtype=np.float32)
    y = np.empty((n, rows), np.float32)
    sec = _time_passes(lambda: native.gemm(w, x, y), min_seconds)
    return KernelResult("gemm", fmt, f"{n}x{cols} @ {rows}x{cols}", native.get_threads(),
                        native.kernel_impl(f"gemm:{fmt}"), sec, 0.0, 0.0, 2.0 * rows * cols * n / sec / 1e9)


def run(formats=FORMATS, rows: int = 10944, cols: int = 2048, gemm_n: int = 128,
        min_seconds: float = 1.0, seed: int = 0, progress=None,
        stream_bytes: int = STREAM_BYTES) -> tuple[float, list[KernelResult]]:
    """(probe GB/s, results). progress(label) is called before each measurement."""
    rng = np.random.default_rng(seed)
    step = progress or (lambda label: None)
    step("read probe")
    probe = read_bandwidth(min_seconds, 2 * stream_bytes)
    results = []
    for fmt in formats:
        step(f"gemv {fmt}")
        results.append(gemv_bandwidth(fmt, rows, cols, min_seconds, probe, rng, stream_bytes))
    if gemm_n > 0:
        for fmt in ("f32", "bf16", "e4m3", "q8", "q4"):
            step(f"gemm {fmt}")
            results.append(gemm_throughput(fmt, 2048, 2048, gemm_n, min_seconds, rng))
    return probe, results


def as_dicts(results: list[KernelResult]) -> list[dict]:
    return [asdict(r) for r in results]
