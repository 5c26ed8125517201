"""Kernel micro-benchmark: GB/s of each GEMV weight format next to a read-bandwidth probe measured in
the same run (the probe is what decode is bound by), and prefill GEMM GFLOP/s next to the peak of the
same run that bounds its arithmetic (bench/peaks.py: the fp32 FMA probe, the bf16 dot probe, or none for
AMX tiles and integer products).

Each measurement cycles over enough copies of the weight that they cannot stay in the last-level
cache, so every pass streams from memory as a real model's decode does. Each GEMV is also timed over
weights that stay in cache (gemv_in_cache): what its instructions allow with memory out of the way.
Below the probe, that format's decode is bound by the core, not by memory.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import numpy as np

from cpumla import native
from cpumla.bench import peaks

STREAM_BYTES = 512 << 20        # copies of a weight add up to at least this much
CACHE_BYTES = 512 << 10         # weight bytes per thread of the in-cache GEMV (half a 1 MiB L2)
FORMATS = ("f32", "bf16", "f16", "e4m3", "e4m3-e8m0", "e2m1", "q8", "q4")
# Which codes an FP8 / FP4 weight holds (--codes): random (every non-NaN code: 1/16 of e4m3 codes are
# subnormals), only subnormal codes (e4m3 exponent field 0; e2m1's +-0.5), or only zero codes. A
# kernel whose speed depended on the values would show it here (on Intel cores a subnormal multiply
# operand costs a microcode assist).
CODES = ("random", "subnormal", "zero")
QUANTISED = ("e4m3", "e4m3-e8m0", "e2m1")
# GGUF's block types (q8_0, q4_k, iq2_xxs, mxfp4, ...: native.GGUF_FORMATS) are measured too when named.
# Their blocks hold random bytes but for the scales, which are set to normal values (random fp16 or E8M0
# bytes would make some subnormal, and a subnormal scale costs a microcode assist on Intel cores): byte
# offsets of each block's fp16 scales (d, and dmin where there is one), its E8M0 scale byte (mxfp4), or
# for iq1_m the fp16 spread over the top nibbles of its four 16-bit sub-scale words (bytes 48-55).
GGUF_F16_AT = {"q8_0": (0,), "q4_0": (0,), "q4_1": (0, 2), "q5_0": (0,), "q5_1": (0, 2), "iq4_nl": (0,),
               "q2_k": (80, 82), "q3_k": (108,), "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,), "iq4_xs": (0,),
               "iq2_xxs": (0,), "iq3_xxs": (0,), "iq1_s": (0,)}
ALL_FORMATS = FORMATS + tuple(native.GGUF_FORMATS)


@dataclass
class KernelResult:
    kernel: str
    format: str
    codes: str               # the code distribution (CODES) of FP8 / FP4 weights, "" for the others
    shape: str
    threads: int
    isa: str
    seconds: float           # per call, median of passes
    gbs: float               # weight (+ scale) bytes read per second; GEMM: 0
    pct_probe: float         # gbs / probe_gbs * 100
    gflops: float
    fma_peak_gflops: float = 0.0   # GEMM: the fp32 FMA probe of the same run (all threads)
    peak: str = ""                 # GEMM: the peak that bounds its arithmetic (bench/peaks.py); "": none does
    peak_gflops: float = 0.0       # GEMM: that peak, measured in the same run
    pct_peak: float | None = None  # GEMM: gflops / peak_gflops * 100 (None without a peak)
    no_peak: str = ""              # GEMM without a peak: what it runs (AMX tiles, int8 dot products)
    cache_gbs: float = 0.0         # GEMV: GB/s over weights that stay in cache (gemv_in_cache)
    probe_gbs: float = 0.0         # GEMV: the read probe right before and after its passes (their mean)


def _codes(fmt: str, codes: str, shape: tuple[int, int], rng: np.random.Generator) -> np.ndarray:
    """Codes of one distribution: e4m3 bytes, or e2m1 nibbles"""
    if fmt.startswith("e4m3"):
        if codes == "subnormal":
            return rng.choice(np.array([m | s for m in range(1, 8) for s in (0, 0x80)], np.uint8), size=shape)
        if codes == "zero":
            return np.zeros(shape, np.uint8)
        q = rng.integers(0, 256, size=shape, dtype=np.uint8)
        q[(q & 0x7F) == 0x7F] &= 0xF7            # no NaN codes
        return q
    if codes == "subnormal":
        return rng.choice(np.array([1, 9], np.uint8), size=shape)
    if codes == "zero":
        return np.zeros(shape, np.uint8)
    return rng.integers(0, 16, size=shape, dtype=np.uint8)


def gguf_weight(fmt: str, rows: int, cols: int, rng: np.random.Generator) -> native.Weight:
    """A GGUF block-type weight of random blocks with normal scales (GGUF_F16_AT)."""
    block, per = native.GGUF_FORMATS[fmt]
    raw = rng.integers(0, 256, (rows * (cols // block), per), dtype=np.uint8)
    n = raw.shape[0]
    half = (rng.uniform(0.2, 1.0, n) * 1e-2).astype(np.float16).view(np.uint16)
    if fmt == "mxfp4":
        raw[:, 0] = rng.integers(118, 124, n, dtype=np.uint8)
    elif fmt == "iq1_m":
        words = raw[:, 48:56].copy().view(np.uint16)            # [n, 4]
        for i in range(4):
            words[:, i] = (words[:, i] & 0x0FFF) | (((half >> (4 * i)) & 0xF) << 12).astype(np.uint16)
        raw[:, 48:56] = words.view(np.uint8)
    for at in GGUF_F16_AT.get(fmt, ()):
        raw[:, at:at + 2] = half.view(np.uint8).reshape(-1, 2)
    return native.Weight(raw.reshape(rows, -1), fmt)


def random_weight(fmt: str, rows: int, cols: int, rng: np.random.Generator, codes: str = "random") -> native.Weight:
    if fmt in native.GGUF_FORMATS:
        return gguf_weight(fmt, rows, cols, rng)
    if fmt == "f32":
        return native.Weight(rng.standard_normal((rows, cols), dtype=np.float32), "f32")
    if fmt == "f16":
        return native.Weight(rng.standard_normal((rows, cols), dtype=np.float32).astype(np.float16), "f16")
    if fmt == "bf16":
        bits = rng.standard_normal((rows, cols), dtype=np.float32).view(np.uint32) >> 16
        return native.Weight(bits.astype(np.uint16), "bf16")
    if fmt.startswith("e4m3"):
        q = _codes(fmt, codes, (rows, cols), rng)
        grid = (-(-rows // 128), -(-cols // 128))
        if fmt == "e4m3-e8m0":
            scale = rng.integers(118, 124, size=grid, dtype=np.uint8)
        else:
            scale = rng.uniform(1e-3, 1e-2, size=grid).astype(np.float32)
        return native.Weight(q, "e4m3", scale)
    if fmt == "e2m1":
        nib = _codes(fmt, codes, (rows, cols), rng)
        q = (nib[:, 0::2] | (nib[:, 1::2] << 4)).astype(np.uint8)
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


def probe_buffer(nbytes: int = STREAM_BYTES * 2) -> np.ndarray:
    """A buffer for read_bandwidth, far larger than any cache (64-byte aligned, as the probe loads)."""
    return native.aligned_copy(np.ones(nbytes // 8, np.float64))


def read_bandwidth(buf: np.ndarray, min_seconds: float = 1.0) -> float:
    """GB/s of the read probe over buf (probe_buffer)."""
    return buf.nbytes / _time_passes(lambda: native.read_probe(buf), min_seconds) / 1e9


def fma_peak(min_seconds: float = 0.3, kind: str = "fp32") -> float:
    """GFLOP/s of the fp32 FMA probe (kind "bf16": the bf16 probe) on every thread, the best of a few
    passes: other work on the machine only ever lowers a pass."""
    native.ensure_init()
    probe = native.lib.cpumla_bf16_probe if kind == "bf16" else native.lib.cpumla_fma_probe
    iters = 1 << 16
    while True:                       # one pass of about a tenth of min_seconds
        t0 = time.perf_counter()
        probe(iters)
        if time.perf_counter() - t0 > min_seconds / 10 or iters > 1 << 34:
            break
        iters *= 2
    best, start = 0.0, time.perf_counter()
    while best == 0.0 or time.perf_counter() - start < min_seconds:
        t0 = time.perf_counter()
        flops = probe(iters)
        best = max(best, flops / (time.perf_counter() - t0) / 1e9)
    return best


def _best_pass(fn, min_seconds: float) -> float:
    """Fastest seconds of one pass of fn() after a warm-up pass: in cache, other work on the machine
    only ever slows a pass."""
    fn()
    best, start, n = float("inf"), time.perf_counter(), 0
    while n < 5 or (time.perf_counter() - start < min_seconds and n < 2000):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        n += 1
    return best


def gemv_in_cache(fmt: str, cols: int, min_seconds: float, rng: np.random.Generator, codes: str = "random") -> float:
    """GB/s of the GEMV over weights that stay in cache (about CACHE_BYTES per thread), timed at two row
    counts so that what a call costs besides its rows (activation operands, the thread pool's wake-up)
    drops out: the bytes of the extra rows over the extra time (where noise hides that difference, the
    larger call's bytes over its time, which can only be lower)."""
    per_row = random_weight(fmt, 1, cols, rng, codes).nbytes
    big = max(64, CACHE_BYTES * native.get_threads() // per_row // 64 * 64)
    small = big // 2
    x = rng.standard_normal(cols, dtype=np.float32)
    times, sizes = [], []
    for rows in (small, big):
        w, y = random_weight(fmt, rows, cols, rng, codes), np.empty(rows, np.float32)
        times.append(_best_pass(lambda: native.gemv(w, x, y), min_seconds / 2))
        sizes.append(w.nbytes)
    extra = times[1] - times[0]
    if extra <= 0:              # timing noise larger than the difference: the larger call's rate, from below
        return sizes[1] / times[1] / 1e9
    return (sizes[1] - sizes[0]) / extra / 1e9


def gemv_bandwidth(fmt: str, rows: int, cols: int, min_seconds: float, probe,
                   rng: np.random.Generator, stream_bytes: int = STREAM_BYTES, codes: str = "random") -> KernelResult:
    """The GEMV's GB/s from memory, against probe() (GB/s) taken right before and after its passes: a
    shared host's bandwidth drifts within a run, and a probe taken once for every format misreads the
    later ones."""
    first = random_weight(fmt, rows, cols, rng, codes)
    copies = [first] + [random_weight(fmt, rows, cols, rng, codes)
                        for _ in range(max(0, -(-stream_bytes // first.nbytes) - 1))]
    x = rng.standard_normal(cols, dtype=np.float32)
    y = np.empty(rows, np.float32)

    def one_pass():
        for w in copies:
            native.gemv(w, x, y)

    before = probe()
    sec = _time_passes(one_pass, min_seconds) / len(copies)
    probe_gbs = (before + probe()) / 2
    gbs = first.nbytes / sec / 1e9
    return KernelResult("gemv", fmt, codes if fmt in QUANTISED else "", f"{rows}x{cols}", native.get_threads(),
                        native.kernel_impl(f"gemv:{fmt.split('-')[0]}"),
                        sec, gbs, 100.0 * gbs / probe_gbs, 2.0 * rows * cols / sec / 1e9,
                        cache_gbs=gemv_in_cache(fmt, cols, min_seconds, rng, codes), probe_gbs=probe_gbs)


def gemm_throughput(fmt: str, rows: int, cols: int, n: int, min_seconds: float,
                    rng: np.random.Generator) -> KernelResult:
    w = random_weight(fmt, rows, cols, rng)
    x = rng.standard_normal((n, cols), dtype=np.float32)
    y = np.empty((n, rows), np.float32)
    sec = _time_passes(lambda: native.gemm(w, x, y), min_seconds)
    return KernelResult("gemm", fmt, "random" if fmt in QUANTISED else "", f"{n}x{cols} @ {rows}x{cols}", native.get_threads(),
                        native.kernel_impl(f"gemm:{fmt}"), sec, 0.0, 0.0, 2.0 * rows * cols * n / sec / 1e9)


# GEMM shapes (tokens, weight rows, columns): prefill of a V2-Lite layer's 2048x2048 product, and an
# expert's product with the ~48 tokens a 512-token prefill routes to each of 64 experts (6 per token)
GEMM_SHAPES = ((128, 2048, 2048), (512, 2048, 2048), (48, 1408, 2048))
GEMM_FORMATS = ("f32", "bf16", "e4m3", "e2m1", "q8", "q4")     # first shape (and GGUF's types asked for);
#                                                                 the others: bf16, e4m3


def run(formats=FORMATS, rows: int = 10944, cols: int = 2048, gemm_n: int = 128,
        min_seconds: float = 1.0, seed: int = 0, progress=None,
        stream_bytes: int = STREAM_BYTES, codes=("random",)) -> tuple[float, list[KernelResult]]:
    """(probe GB/s, results). progress(label) is called before each measurement. FP8 / FP4 GEMVs run
    once per code distribution in codes; each GEMV's share is of the probe taken around it
    (KernelResult.probe_gbs), the first value returned is the probe at the start."""
    rng = np.random.default_rng(seed)
    step = progress or (lambda label: None)
    step("read probe")
    buf = probe_buffer(2 * stream_bytes)
    first_probe = read_bandwidth(buf, min_seconds)

    def probe() -> float:
        return read_bandwidth(buf, min(min_seconds, 0.25))

    results = []
    for fmt in formats:
        for c in codes if fmt in QUANTISED else ("random",):
            step(f"gemv {fmt}" + (f" ({c} codes)" if fmt in QUANTISED else ""))
            results.append(gemv_bandwidth(fmt, rows, cols, min_seconds, probe, rng, stream_bytes, c))
    if gemm_n > 0:
        step("fma probe")
        peak = fma_peak(min(min_seconds, 0.5))
        gemms = []
        for i, (n, r, c) in enumerate(GEMM_SHAPES):
            gguf = [f for f in formats if f in native.GGUF_FORMATS]          # the GGUF types asked for too
            for fmt in (*GEMM_FORMATS, *gguf) if i == 0 else ("bf16", "e4m3"):
                step(f"gemm {fmt} {n if i else gemm_n} tokens")
                gemms.append(gemm_throughput(fmt, r, c, gemm_n if i == 0 else n, min_seconds, rng))
        step("fma probe")
        peak = max(peak, fma_peak(min(min_seconds, 0.5)))       # before and after: the better one
        measured = {peaks.FMA: peak}
        dot = peaks.dot_name()
        bounds = [peaks.bound(g.format, g.isa, *[int(g.shape.split("x")[0])] * 2) for g in gemms]
        if dot is not None and any(name == dot for name, _ in bounds):
            step("bf16 dot probe")
            measured[dot] = fma_peak(min(min_seconds, 0.5), "bf16")
        if any(name in (peaks.TILE_BF16, peaks.TILE_INT8) for name, _ in bounds):
            step("tile probe")
            measured.update(peaks.tile_peaks(min(min_seconds, 0.5) / 2))
        for g, (name, runs) in zip(gemms, bounds):
            g.fma_peak_gflops = peak
            if name is None:
                g.no_peak = runs
            elif measured.get(name, 0.0) <= 0:
                g.no_peak = f"{runs} (the {name} peak not measured)"
            else:
                g.peak, g.peak_gflops = name, measured[name]
                g.pct_peak = peaks.percent(g.gflops, g.peak_gflops)
        results += gemms
    return first_probe, results


def as_dicts(results: list[KernelResult]) -> list[dict]:
    return [asdict(r) for r in results]
