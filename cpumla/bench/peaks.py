"""Which measured peak bounds a product, so that a "% of peak" is only ever said against a ceiling of
what ran.

The library has two arithmetic probes (cpumla.h): fp32 FMAs, and the multiply-adds of bf16 weights, which
are bf16 dot products (vdpbf16ps) on the avx512 level and the same fp32 FMAs on every level without
them. What a product in a weight format runs, by the level that serves it (cpumla_kernel_impl's text,
whose first word is that level):
- f32 and f16 weights: fp32 FMAs everywhere, bounded by the fp32 FMA peak;
- bf16 and e4m3 weights: bf16 dot products where the level serving them is the one the bf16 probe runs
  on (bounded by that probe's peak), fp32 FMAs elsewhere;
- anything the amx level serves (from 16 tokens on): AMX tile multiplies, bounded by the tile probe's
  peak (cpumla_tile_probe): bf16 tiles for bf16 and e4m3 weights, int8 tiles for the integer formats;
- integer formats (q8, q4, e2m1 and GGUF's block types): int8 dot products (vpdpbusd, vpmaddubsw,
  sdot), which no probe bounds either; but e2m1 from as many tokens as a level names ("fp32 FMAs from 12
  tokens"): fp32 FMAs.
A product with no ceiling gets its GFLOP/s and no percentage. A mix of products (a model's prefill, its
attention in fp32 FMAs) is bounded by the highest peak among those of its parts, and by none when any
part has none."""

from __future__ import annotations

import re
import time

from cpumla import native

FMA = "fp32 FMA"
FLOAT_FORMATS = ("f32", "f16")
BF16_FORMATS = ("bf16", "e4m3")          # their products multiply bf16-rounded activations
TILES = "AMX tiles"
TILE_BF16 = "AMX bf16 tile"
TILE_INT8 = "AMX int8 tile"
INTEGER = "int8 dot products"


def dot_name() -> str | None:
    """The name of the bf16 probe's peak when it is a dot-product instruction of its own, None where that
    probe is the fp32 FMA loop."""
    dot = native.kernel_impl("bf16_probe")
    if dot == native.kernel_impl("fma_probe"):
        return None
    return "AVX-512 bf16 dot" if dot == "avx512" else f"{dot} bf16 dot"


def bound(fmt: str, impl: str, fewest: int | None = None, most: int | None = None) -> tuple[str | None, str]:
    """(the peak that bounds a product of weights in `fmt` served by `impl`, or None; what it runs). With
    the fewest and the most tokens its calls multiply, the hand-backs impl names by tokens are followed
    ("amx (avx512 below 16 tokens)", "avx2 (fp32 FMAs from 12 tokens; ...)"); without, the first level
    named serves it."""
    level = impl.split()[0] if impl else ""
    below = re.search(r"\((\w+) below (\d+) tokens", impl or "")
    if below and most is not None and most < int(below[2]):
        level = below[1]
    fmt = fmt.split("-")[0]                        # e4m3-e8m0: e4m3 with E8M0 block scales
    if level == "amx":
        if fmt in FLOAT_FORMATS:
            return None, TILES              # the tiles take no f32 / f16 weights: nothing known bounds it
        return (TILE_BF16 if fmt in BF16_FORMATS else TILE_INT8), TILES
    if fmt in FLOAT_FORMATS:
        return FMA, "fp32 FMAs"
    if fmt in BF16_FORMATS:
        dot = dot_name()
        if dot is not None and level == native.kernel_impl("bf16_probe"):
            return dot, "bf16 dot products"
        return FMA, "fp32 FMAs"
    fma_from = re.search(r"fp32 FMAs from (\d+) tokens", impl or "")
    if fma_from and fewest is not None and fewest >= int(fma_from[1]):
        return FMA, "fp32 FMAs"
    return None, INTEGER


def gemm_bound(fmt: str, most: int | None = None) -> tuple[str | None, str]:
    """bound() of GEMMs in `fmt` of at most `most` tokens at the level running now."""
    impl = native.kernel_formats()["gemm"].get(fmt.split("-")[0])
    return bound(fmt, impl, most=most) if impl else (None, f"{fmt} products")


def ceiling(formats, peaks: dict[str, float], most: int | None = None) -> tuple[str | None, float, str]:
    """(name, GFLOP/s) of the peak bounding a mix of GEMMs in `formats` (of at most `most` tokens) and fp32
    FMA work, from the measured `peaks` by name; (None, 0.0, what has no ceiling) when a part has none."""
    names = {FMA}
    for f in sorted(set(formats)):
        name, runs = gemm_bound(f, most)
        if name is None:
            return None, 0.0, runs
        names.add(name)
    missing = sorted(n for n in names if peaks.get(n, 0.0) <= 0)
    if missing:
        return None, 0.0, f"{missing[0]} products (that peak not measured)"
    best = max(names, key=lambda n: peaks[n])
    return best, peaks[best], ""


def percent(gflops: float, peak_gflops: float) -> float | None:
    return 100.0 * gflops / peak_gflops if peak_gflops > 0 else None


def rate(probe, seconds: float, iters: int = 1 << 16) -> float:
    """G operations/s of probe(iters) -> operations, iters doubled until one call lasts `seconds`; 0.0
    when the probe does nothing."""
    while True:
        t0 = time.perf_counter()
        ops = probe(iters)
        dt = time.perf_counter() - t0
        if ops == 0:
            return 0.0
        if dt > seconds or iters > 1 << 34:
            return ops / dt / 1e9
        iters *= 2


def tile_peaks(seconds: float = 0.2) -> dict[str, float]:
    """GFLOP/s (int8: G operations/s) of the AMX tiles' bf16 and int8 products on every thread, by name;
    empty where the level running has no tiles."""
    native.ensure_init()
    out = {name: rate(lambda it, k=kind: native.lib.cpumla_tile_probe(k, it), seconds, 1 << 10)
           for name, kind in ((TILE_BF16, 0), (TILE_INT8, 1))}
    return out if all(out.values()) else {}
