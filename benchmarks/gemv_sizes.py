"""GEMV read rate by weight size, for builds alternated in one process.

Decode runs hundreds of GEMVs a token, most of them 0.5-4 MB (q4 at V2-Lite widths: kv_a 0.66 MB,
an expert's gate 1.6 MB, q_proj 3.5 MB). This times back-to-back `cpumla_gemv` calls over sets of
distinct weights of each size (each set ~170 MB, so every call streams from memory where the
last-level cache is tens of MB; `--scale 6` makes them ~1 GB for a cache of hundreds; all in 2 MiB huge
pages, as the loader places quantized weights), between two passes of the read probe, and files each
sample by that probe. Each TREE is a source tree with a built library (`python3 setup.py build_ext
--inplace`); their libraries are loaded side by side (each with its own thread pool) and take turns,
so builds are compared on the same host phase. Without TREE, the installed cpumla's library is timed.
TREE@ISA runs that tree's library at one implementation level, and TREE@ISA@l1, @l2 or @l2+l1 with its GEMV
prefetch target set (cpumla_set_gemv_prefetch), so one build's levels or targets take turns too
(`.` is the installed library):

    python3 benchmarks/gemv_sizes.py --format q4 --seconds 120 /tmp/old /tmp/new
    python3 benchmarks/gemv_sizes.py --format q8 --seconds 60 .@avx512@l1 .@avx512@l2 .@avx2

`--kv-b` times the MLA per-head products instead, on a set of V2-Lite-shaped `kv_b_proj` weights (16
heads of 128 + 128 rows, 512 columns): `absorb` (`cpumla_head_gemv_t` over each head's first 128 rows)
and `un-absorb` (`cpumla_head_gemv` over the other 128), each counted as the half of the bytes it reads:

    python3 benchmarks/gemv_sizes.py --kv-b --format q8 --seconds 60 /tmp/old /tmp/new

`--moe` times one-token `cpumla_moe` calls instead, the decode step of a MoE layer: `routed` picks 6 of
a table of 256 V2-Lite-shaped experts (gate / up 1408 x 2048, down 2048 x 1408) at random, and `wide`
runs one expert of the same bytes (intermediate 6 x 1408) from a set of 32; both count the experts'
bytes. Each set is ~2 GB at q8 (caches of several hundred MB would hold a smaller one).
A thread's span of `routed` crosses from one expert matrix to the next a few times a call, `wide`'s
does not, so the two differ by what those crossings cost:

    python3 benchmarks/gemv_sizes.py --moe --format q8 --seconds 60 /tmp/old /tmp/new

Prints, per phase of the probe and tree, the mean GB/s of each size as % of the probe.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import shutil
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

from cpumla import native
from cpumla.bench import kernels as nb
from cpumla.checkpoint.arena import hugepage_empty

# name: rows (columns: --cols, 2048 by default), and how many distinct weights make a set at 2048
SIZES = {"576 rows": (576, 256), "1408 rows": (1408, 104), "3072 rows": (3072, 48), "49152 rows": (49152, 3)}
COLS = 2048
KV_B = (16, 128, 128, 512)      # --kv-b: heads, absorb rows, un-absorb rows a head, columns
KV_B_SET = 170 << 20            # bytes of kv_b weights in a set
MOE = (256, 6, 1408, 2048)      # --moe: experts in the table, experts a token, intermediate, hidden
MOE_WIDE = 32                   # --moe: the wide experts in a set
MOE_PICKS = 32                  # --moe: the random choices of experts a pass takes in turn


def _library(spec: str | None, n: int, tmp: Path) -> ctypes.CDLL:
    """The library of a TREE[@ISA[@PREFETCH]] spec (the n-th), initialised, always loaded from a copy:
    ctypes would hand back a file already loaded, with its one table and one pool, and the installed
    library is the one `cpumla.native` runs the probe on and resets to its own level when it starts."""
    tree, isa, where = ((spec or ".").split("@") + ["", ""])[:3]
    path = Path(tree) / "cpumla" / "native" / "_cpumla.abi3.so" if tree != "." else Path(native.__file__).with_name("_cpumla.abi3.so")
    if not path.is_file():
        raise SystemExit(f"gemv_sizes.py: no built library at {path} (run python3 setup.py build_ext --inplace there)")
    copy = tmp / f"lib{n}.so"
    shutil.copyfile(path, copy)
    lib = ctypes.CDLL(str(copy))
    lib.cpumla_last_error.restype = lib.cpumla_isa.restype = ctypes.c_char_p
    if lib.cpumla_init(isa.encode()) != 0:
        raise SystemExit(f"gemv_sizes.py: {spec}: {lib.cpumla_last_error().decode()}")
    if where and lib.cpumla_set_gemv_prefetch(where.encode()) != 0:
        raise SystemExit(f"gemv_sizes.py: {spec}: {lib.cpumla_last_error().decode()}")
    return lib


def _huge(w: native.Weight) -> native.Weight:
    """w copied into huge pages (codes and scales)."""
    data = hugepage_empty(w.data.shape, w.data.dtype, small=True)
    data[:] = w.data
    scale = None
    if w.scale is not None:
        scale = hugepage_empty(w.scale.shape, w.scale.dtype, small=True)
        scale[:] = w.scale
    return native.Weight(data, w.dtype, scale)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trees", nargs="*", help="source trees with a built library, each TREE[@ISA[@l1|l2|l2+l1]] "
                    "(default: the installed one)")
    ap.add_argument("--format", default="q4", choices=["bf16", "e4m3", "e2m1", "q8", "q4"])
    ap.add_argument("--seconds", type=float, default=60.0, help="how long to take samples")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cols", type=int, default=COLS, help="columns of every weight (1408: V2-Lite's expert "
                    "down projections, whose rows are not whole steps of the integer GEMVs)")
    ap.add_argument("--scale", type=float, default=1.0, help="each set's weights times this (tests: small; up to "
                    "16: sets well past a last-level cache of several hundred MB)")
    ap.add_argument("--slow-below", type=float, default=55.0, help="probe GB/s under which a sample is 'slow'")
    ap.add_argument("--fast-above", type=float, default=65.0, help="probe GB/s over which a sample is 'fast'")
    ap.add_argument("--kv-b", action="store_true", help="time the MLA absorb and un-absorb of kv_b_proj "
                    "weights instead of GEMVs")
    ap.add_argument("--moe", action="store_true", help="time one-token MoE calls (routed: 6 of 256 experts; wide: "
                    "one expert of the same bytes) instead of GEMVs")
    ap.add_argument("--json", action="store_true", help="one JSON object instead of text")
    a = ap.parse_args(argv)
    if a.kv_b and a.moe:
        ap.error("--kv-b and --moe time different things: give one")
    if a.threads < 1 or not 0 < a.scale <= 16 or a.cols < 32 or a.cols % 32:
        ap.error("--threads must be at least 1, --scale in (0, 16] and --cols a multiple of 32")
    trees = a.trees or [None]
    native.set_threads(a.threads)               # cpumla.native at its own level before the copies load
    tmp = Path(tempfile.mkdtemp(prefix="gemv_sizes"))
    try:
        libs = [_library(t, n, tmp) for n, t in enumerate(trees)]
    finally:
        shutil.rmtree(tmp)         # the copies stay mapped while loaded
    for lib in libs:
        lib.cpumla_set_threads(a.threads)
    rng = np.random.default_rng(0)
    H, dn, dv, R = KV_B
    if a.kv_b:                                  # one set of weights, read by both products
        first = _huge(nb.random_weight(a.format, H * (dn + dv), R, rng))
        kv = [first] + [_huge(nb.random_weight(a.format, H * (dn + dv), R, rng))
                        for _ in range(max(1, int(KV_B_SET // first.nbytes * a.scale)) - 1)]
        sets = {"absorb": kv, "un-absorb": kv}
    elif a.moe:
        E, K, I, D = MOE

        def table(n: int, inter: int):
            """an expert table of n experts (huge pages) and the Weights it points at"""
            keep = [tuple(_huge(nb.random_weight(a.format, r, c, rng)) for r, c in ((inter, D), (inter, D), (D, inter)))
                    for _ in range(max(1, n))]
            t = native.ffi.new("cpumla_expert[]", len(keep))
            for i, (g, u, d) in enumerate(keep):
                t[i].gate, t[i].up, t[i].down = g.c[0], u.c[0], d.c[0]
            return t, keep
        routed = table(int(E * a.scale), I)
        wide = table(int(MOE_WIDE * a.scale), K * I)
        n_routed = len(routed[1])
        picks = [np.ascontiguousarray(rng.choice(n_routed, K, replace=K > n_routed), np.int32) for _ in range(MOE_PICKS)]
        moe = {"routed": (routed, K, picks), "wide": (wide, 1, [np.array([i], np.int32) for i in range(len(wide[1]))])}
        # a pass: each choice of experts once, counting the chosen experts' bytes
        sets = {n: c for n, (_, _, c) in moe.items()}
        ptrs = {n: [ctypes.c_void_p(p.ctypes.data) for p in c] for n, c in sets.items()}
        nbytes = {n: len(c) * k * sum(w.nbytes for w in t[1][0]) for n, (t, k, c) in moe.items()}
        gates = {n: ctypes.c_void_p(int(native.ffi.cast("intptr_t", t[0]))) for n, (t, _, _) in moe.items()}
        weights = {n: np.full(k, 1.0 / k, np.float32) for n, (_, k, _) in moe.items()}
        h = np.zeros(D, np.float32)
    else:
        # each set keeps its bytes (~170 MB) at any width
        sets = {name: [_huge(nb.random_weight(a.format, rows, a.cols, rng))
                       for _ in range(max(1, int(n * COLS / a.cols * a.scale)))]
                for name, (rows, n) in SIZES.items()}
    if not a.moe:
        ptrs = {name: [ctypes.c_void_p(int(native.ffi.cast("intptr_t", w.c))) for w in ws] for name, ws in sets.items()}
        nbytes = {name: sum(w.nbytes for w in ws) // (2 if a.kv_b else 1) for name, ws in sets.items()}
    x = rng.standard_normal(max(a.cols, H * R, MOE[3])).astype(np.float32)
    y = np.zeros(max(max(rows for rows, _ in SIZES.values()), H * R), np.float32)
    xp, yp = ctypes.c_void_p(x.ctypes.data), ctypes.c_void_p(y.ctypes.data)
    i64 = ctypes.c_int64
    for lib in libs:
        for f in (lib.cpumla_head_gemv_t, lib.cpumla_head_gemv):    # w, row0, stride, rows, H, n, x, ldx_t,
            f.argtypes = [ctypes.c_void_p] + [i64] * 5 + [ctypes.c_void_p, i64, i64, ctypes.c_void_p, i64, i64]
        lib.cpumla_moe.argtypes = [ctypes.c_void_p, i64, ctypes.c_void_p, i64, i64, ctypes.c_void_p, ctypes.c_void_p,
                                   i64, ctypes.c_void_p, i64, ctypes.c_float]

    def call(lib, name: str):
        """the timed call of a set's weight: its GEMV, or the per-head product"""
        if name == "absorb":       # x [H, dn] -> y [H, R]
            return lambda p: lib.cpumla_head_gemv_t(p, 0, dn + dv, dn, H, 1, xp, H * dn, dn, yp, H * R, R)
        if name == "un-absorb":    # x [H, R] -> y [H, dv]
            return lambda p: lib.cpumla_head_gemv(p, dn, dn + dv, dv, H, 1, xp, H * R, R, yp, H * dv, dv)
        if a.moe:                  # p: the chosen experts' indices
            (t, keep), k, _ = moe[name]
            wp, hp = ctypes.c_void_p(weights[name].ctypes.data), ctypes.c_void_p(h.ctypes.data)
            return lambda p: lib.cpumla_moe(gates[name], len(keep), xp, MOE[3], 1, p, wp, k, hp, MOE[3], 0.0)
        return lambda p: lib.cpumla_gemv(p, xp, yp)
    probe_buf = nb.probe_buffer(1 << 29)

    def probe() -> float:
        t0 = time.perf_counter()
        native.read_probe(probe_buf)
        return probe_buf.nbytes / (time.perf_counter() - t0) / 1e9

    def rate(lib, name: str) -> float:
        gemv = call(lib, name)
        t0 = time.perf_counter()
        for _ in range(2):
            for p in ptrs[name]:
                gemv(p)
        return 2 * nbytes[name] / (time.perf_counter() - t0) / 1e9

    for spec, lib in zip(trees, libs):          # warm-up: first touches, workers started
        for name in sets:
            y[:] = 0.0
            if a.moe:
                h[:] = 0.0
                if call(lib, name)(ptrs[name][0]) != 0 or not np.isfinite(h).all() or not h.any():
                    raise SystemExit(f"gemv_sizes.py: {spec or 'installed'}: {name} MoE failed "
                                     f"({lib.cpumla_last_error().decode() or 'no output'})")
            if a.kv_b and (call(lib, name)(ptrs[name][0]) != 0 or not np.isfinite(y).all() or not y.any()):
                raise SystemExit(f"gemv_sizes.py: {spec or 'installed'}: {name} failed "
                                 f"({lib.cpumla_last_error().decode() or 'no output'})")
            rate(lib, name)
    samples = []                                # (tree index, probe GB/s, {size: GB/s})
    end = time.time() + a.seconds
    while not samples or time.time() < end:
        for i, lib in enumerate(libs):
            time.sleep(0.002)                   # the other pools' workers go back to sleep
            before = probe()
            time.sleep(0.002)
            got = {name: rate(lib, name) for name in sets}
            samples.append((i, (before + probe()) / 2, got))

    names = [str(t or "installed") for t in trees]
    isas = {n: lib.cpumla_isa().decode() for n, lib in zip(names, libs)}    # the levels run, read after the samples
    out = {"format": a.format, "threads": a.threads, "cols": a.cols, "set_bytes": nbytes, "isa": isas, "phases": {}}
    for phase, keep in (("slow", lambda p: p < a.slow_below), ("fast", lambda p: p > a.fast_above),
                        ("all", lambda p: True)):
        rows = defaultdict(list)
        for i, p, got in samples:
            if keep(p):
                rows[i].append((p, got))
        out["phases"][phase] = {
            names[i]: {"samples": len(r), "probe_gbs": float(np.mean([p for p, _ in r])),
                       "pct_probe": {n: float(np.mean([100 * g[n] / p for p, g in r])) for n in sets}}
            for i, r in sorted(rows.items())}
    if a.json:
        print(json.dumps(out))
        return
    what = (f"kv_b_proj {H} x ({dn} + {dv}) x {R}, per-head products" if a.kv_b else
            f"one-token MoE, {MOE[1]} of {MOE[0]} experts {MOE[2]} x {MOE[3]} or one {MOE[1]}x as wide" if a.moe
            else f"GEMV, {a.cols} columns")
    print(f"{a.format} {what}, {a.threads} threads, % of the probe by weight size")
    print("levels: " + ", ".join(f"{t} {i}" for t, i in isas.items()))
    for phase, per_tree in out["phases"].items():
        for tree, r in per_tree.items():
            sizes = "  ".join(f"{n} {v:5.1f}" for n, v in r["pct_probe"].items())
            print(f"{phase:5s} {tree}: {r['samples']} samples, probe {r['probe_gbs']:.1f} GB/s  {sizes}")


if __name__ == "__main__":
    main()
