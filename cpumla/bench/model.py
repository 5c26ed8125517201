"""Model benchmark in the spirit of llama-bench: prefill (pp) and decode (tg) tests at KV depths,
with the machine's own limits measured in the same run (read bandwidth, FMA peak) to say how close
each test runs to them. The library never prints; the CLI renders."""

from __future__ import annotations

import math
import os
import platform
import resource
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from cpumla import native
from cpumla.bench import peaks
from cpumla.errors import CpumlaError


@dataclass
class TestResult:
    # llama-bench field names
    model_type: str
    model_filename: str
    cpu_info: str
    n_threads: int
    n_prompt: int
    n_gen: int
    n_depth: int
    test: str                      # "pp512", "tg128", with "@ d2048" when n_depth > 0
    avg_ns: float
    stddev_ns: float
    avg_ts: float
    stddev_ts: float
    samples_ns: list[float] = field(default_factory=list)
    samples_ts: list[float] = field(default_factory=list)
    # ours
    isa: str = ""
    bytes_per_token: float = 0.0   # decode: weight + cache bytes read per token
    gbs: float = 0.0               # decode: bytes_per_token * tok/s
    pct_bandwidth: float = 0.0     # of the read probe
    gflops: float = 0.0            # prefill
    peak: str | None = None        # prefill: the peak that bounds its products (bench/peaks.py); None: none does
    peak_gflops: float = 0.0       # that peak, measured in the same run
    pct_peak: float | None = None  # gflops / peak_gflops * 100 (None without a peak)
    no_peak: str = ""              # without a peak: what of the prefill no probe bounds
    ttft_ms: float = 0.0           # prefill: time to the first token's logits
    read_probe_gbs: float = 0.0
    fma_peak_gflops: float = 0.0   # the fp32 FMA probe
    bf16_peak_gflops: float = 0.0  # the bf16 probe (bf16 dot products where the level has them, fp32 FMAs elsewhere)
    amx_bf16_peak_gflops: float = 0.0  # the AMX tiles' bf16 products (0: no tiles at this level)
    amx_int8_peak_gflops: float = 0.0  # the AMX tiles' int8 products, G operations/s
    load_s: float = 0.0
    peak_rss_mb: float = 0.0
    # routed experts read from disk (an engine with an ExpertStream); None otherwise
    expert_hit_rate: float | None = None     # of the experts the measured runs asked for, those in a slot
    disk_bytes_per_token: float | None = None
    disk_read_gbps: float | None = None      # the expert reads' GB/s while any was in flight
    disk_probe_gbps: float | None = None     # direct reads of the model's largest file, in the same run


def peak_rss_mb() -> float:
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kb / 1024.0 if platform.system() == "Linux" else kb / 1e6


def decode_bytes(eng, depth: int) -> float:
    """Bytes one decode token reads at cache depth `depth` (the model family counts them)."""
    return eng.model.decode_bytes(depth)


def prefill_flops(eng, n: int, depth: int) -> float:
    """FLOPs of a prefill of n tokens after `depth` cached ones (the model family counts them)."""
    return eng.model.prefill_flops(n, depth)


def fma_peak_gflops(seconds: float = 0.3, kind: str = "fp32") -> float:
    """Multiply-add throughput of every thread together, from the library's probe: kind "fp32" (FMA)
    or "bf16" (the products of bf16 weights: bf16 dot products where the CPU has them)."""
    native.ensure_init()
    return peaks.rate(native.lib.cpumla_bf16_probe if kind == "bf16" else native.lib.cpumla_fma_probe, seconds)


class AtDepth:
    """Puts the cache at a depth: the first `depth` rows of one fixed run of random tokens. A test
    overwrites the rows past its depth, so `valid` counts the leading rows that still hold that run;
    a deeper depth prefills only the missing rows. A deep cache is built once per run, not once per
    repetition."""

    def __init__(self, eng, deepest: int, rng):
        self.eng, self.valid = eng, 0
        self.tokens = rng.integers(0, eng.config.vocab_size, size=deepest)

    def __call__(self, depth: int) -> None:
        self.eng.truncate(min(self.valid, depth))
        if depth > self.valid:
            self.eng.forward(self.tokens[self.valid:depth], last_only=True)
        self.eng.truncate(depth)
        self.valid = depth          # the test writes the rows past depth


class BandwidthProbe:
    """Read bandwidth right now. The host's bandwidth drifts (other tenants), so the bench probes right
    before and after each test. The probe reads the model's own largest tensors (already resident, so
    it adds nothing to the peak RSS, and it is the memory decode streams from); with less than min_bytes
    (256 MiB) of them it reads a buffer of its own. Anything under ~8x the last-level cache reads high."""

    MIN_BYTES = 256 << 20

    def __init__(self, arrays=(), min_bytes: int = MIN_BYTES):
        spans, total = [], 0
        for a in sorted(arrays, key=lambda a: -a.nbytes):
            if total >= 4 * min_bytes:
                break
            start = native.ffi.cast("uintptr_t", native.vptr(a))
            skip = (-int(start)) % 64                         # the kernels read whole aligned lines
            n = (a.nbytes - skip) & ~63
            if n > 0:
                spans.append((native.ffi.cast("char *", start) + skip, n))
                total += n
        self._keep = list(arrays)
        if total < min_bytes:
            self._own = np.ones(min_bytes // 8, np.float64)
            spans, total = [(native.ffi.cast("char *", native.vptr(self._own)), self._own.nbytes)], self._own.nbytes
        self.spans, self.nbytes = spans, total

    def _read(self):
        for ptr, n in self.spans:
            native.lib.cpumla_read_probe(ptr, n)

    def __call__(self, passes: int = 3) -> float:
        self._read()
        best = min(_timed(self._read) for _ in range(passes))
        return self.nbytes / best / 1e9


class DiskProbe:
    """Direct-read speed of the file system the model's experts come from: 1 MiB reads, as many in flight
    as the expert stream has, of the first GiB of the largest of its files (the page cache bypassed)."""

    BYTES = 1 << 30

    def __init__(self, eng):
        from cpumla.runtime.streaming import IO_THREADS

        self.threads = IO_THREADS
        files = sorted(eng._src.mappings(), key=lambda f: -f[1])
        self.path = files[0][2]

    def __call__(self) -> float:
        from cpumla.native.stream import disk_probe

        return disk_probe(self.path, self.BYTES, self.threads)[0] / 1e9


def weight_formats(model) -> set[str]:
    """The formats of every weight a model multiplies: its layers' linears, expert tables and head."""
    found, seen, todo = set(), set(), [model]
    while todo:
        o = todo.pop()
        if id(o) in seen:
            continue
        seen.add(id(o))
        if isinstance(o, native.Weight):
            found.add(o.dtype)
        elif isinstance(o, dict):
            todo.extend(o.values())
        elif isinstance(o, (list, tuple)):
            todo.extend(o)
        elif type(o).__module__.startswith("cpumla.") and hasattr(o, "__dict__"):
            todo.extend(vars(o).values())
    return found


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run(eng, *, model_name: str, n_prompt: int, n_gen: int, reps: int, threads: list[int], depths: list[int],
        load_s: float, probe: BandwidthProbe, peak_gflops: dict[int, float], progress=None, seed: int = 0,
        bf16_peak_gflops: dict[int, float] | None = None, tile_peak_gflops: dict[int, dict] | None = None):
    """Yields TestResult for each (threads, depth, test). progress(label, done, total) is called.
    peak_gflops / bf16_peak_gflops: the fp32 FMA / bf16 probes' GFLOP/s by thread count, tile_peak_gflops
    the AMX tiles' (bench/peaks.tile_peaks, by name); a prefill's share is of the one that bounds its
    products (bench/peaks.py), or of none."""
    cfg = eng.config
    stream = eng.stream
    disk = DiskProbe(eng) if stream is not None else None
    rng = np.random.default_rng(seed)
    tests = [("pp", n_prompt) for _ in [0] if n_prompt > 0] + [("tg", n_gen) for _ in [0] if n_gen > 0]
    total = len(threads) * len(depths) * len(tests) * (reps + 1)
    done = 0
    at_depth = AtDepth(eng, max(depths), np.random.default_rng([seed, 1]))
    formats, dot = weight_formats(eng.model), peaks.dot_name()
    for t in threads:
        native.set_threads(t)
        for d in depths:
            for kind, n in tests:
                samples = []
                probe_before = probe()
                disk_gbs = disk() if disk is not None else None
                for rep in range(reps + 1):                  # the first run is the warm-up
                    if progress:
                        progress(f"{kind}{n} d{d} t{t}", done, total)
                    at_depth(d)
                    ids = rng.integers(0, cfg.vocab_size, size=n)
                    if kind == "pp":
                        t0 = time.perf_counter_ns()
                        eng.forward(ids, last_only=True)
                        ns = time.perf_counter_ns() - t0
                    else:                                     # n one-token forwards; sampling excluded
                        t0 = time.perf_counter_ns()
                        for tok in ids:
                            eng.forward([int(tok)], last_only=True)
                        ns = time.perf_counter_ns() - t0
                    done += 1
                    if rep:
                        samples.append(ns)
                    elif stream is not None:                 # counted over the measured runs only
                        stream.reset_stats()
                probe_gbs = (probe_before + probe()) / 2
                ns = np.array(samples, dtype=np.float64)
                ts = n / (ns / 1e9)
                r = TestResult(cfg.model_type, model_name, native.cpu_name(), t, n if kind == "pp" else 0,
                               n if kind == "tg" else 0, d, f"{kind}{n}" + (f" @ d{d}" if d else ""),
                               float(ns.mean()), float(ns.std()), float(ts.mean()), float(ts.std()),
                               ns.tolist(), ts.tolist(), native.isa(), read_probe_gbs=probe_gbs,
                               fma_peak_gflops=peak_gflops.get(t, 0.0),
                               bf16_peak_gflops=(bf16_peak_gflops or {}).get(t, 0.0), load_s=load_s,
                               amx_bf16_peak_gflops=(tile_peak_gflops or {}).get(t, {}).get(peaks.TILE_BF16, 0.0),
                               amx_int8_peak_gflops=(tile_peak_gflops or {}).get(t, {}).get(peaks.TILE_INT8, 0.0),
                               peak_rss_mb=peak_rss_mb())
                if stream is not None:
                    st = stream.stats()
                    r.expert_hit_rate, r.disk_read_gbps, r.disk_probe_gbps = st.hit_rate, st.read_gbps, disk_gbs
                    r.disk_bytes_per_token = st.bytes_read / (n * reps)
                if kind == "tg":
                    mid = d + n / 2
                    r.bytes_per_token = decode_bytes(eng, int(mid))
                    r.gbs = r.bytes_per_token * r.avg_ts / 1e9
                    r.pct_bandwidth = 100.0 * r.gbs / probe_gbs if probe_gbs else 0.0
                else:
                    r.gflops = prefill_flops(eng, n, d) / (r.avg_ns / 1e9) / 1e9
                    measured = {peaks.FMA: r.fma_peak_gflops, **({dot: r.bf16_peak_gflops} if dot else {}),
                                peaks.TILE_BF16: r.amx_bf16_peak_gflops, peaks.TILE_INT8: r.amx_int8_peak_gflops}
                    r.peak, r.peak_gflops, r.no_peak = peaks.ceiling(formats, measured, most=n)
                    r.pct_peak = peaks.percent(r.gflops, r.peak_gflops)
                    r.ttft_ms = r.avg_ns / 1e6
                yield r
    native.set_threads(None)


def check_args(eng_ctx: int, n_prompt: int, n_gen: int, reps: int, threads: list[int], depths: list[int]) -> list[str]:
    """Raises CpumlaError for impossible settings; returns warnings for questionable ones."""
    if n_prompt < 0 or n_gen < 0 or (n_prompt == 0 and n_gen == 0):
        raise CpumlaError("nothing to measure: -p and -n are both 0 (or negative)")
    if reps < 1:
        raise CpumlaError("-r must be at least 1")
    if not threads or min(threads) < 1:
        raise CpumlaError("-t needs thread counts >= 1")
    if max(threads) > native.MAX_THREADS:
        raise CpumlaError(f"-t {max(threads)}: the thread pool runs at most {native.MAX_THREADS} threads")
    if not depths or min(depths) < 0:
        raise CpumlaError("-d needs depths >= 0")
    need = max(depths) + max(n_prompt, n_gen) + 1
    if need > eng_ctx:
        raise CpumlaError(f"depth {max(depths)} + {max(n_prompt, n_gen)} tokens needs a context of {need}, "
                          f"past the model's {eng_ctx}")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return [f"{t} threads is more than the {cores} cores here; running anyway" for t in threads if t > cores]


def as_dict(r: TestResult) -> dict:
    d = asdict(r)
    for k, v in d.items():
        if isinstance(v, float) and not math.isfinite(v):
            d[k] = None
    return d
