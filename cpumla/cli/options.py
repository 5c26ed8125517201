"""Checks of options several commands share, so that each is one rule everywhere."""

from __future__ import annotations

import os

from cpumla.errors import CpumlaError


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def check_threads(threads, flag: str = "--threads") -> list[str]:
    """None (one thread per core) or counts >= 1; returns warnings for counts above the cores here."""
    if threads is None:
        return []
    counts = threads if isinstance(threads, (list, tuple)) else [threads]
    if not counts or min(counts) < 1:
        raise CpumlaError(f"{flag} must be at least 1 (leave it out for one thread per core)")
    from cpumla.native import MAX_THREADS

    if max(counts) > MAX_THREADS:
        raise CpumlaError(f"{flag} {max(counts)} is more than the thread pool's {MAX_THREADS}")
    n = cores()
    return [f"{t} threads is more than the {n} cores here; running anyway" for t in counts if t > n]


def check_ctx(ctx, trained: int) -> list[str]:
    """--ctx: None (the default), or >= 1; a warning above the model's trained length."""
    if ctx is None:
        return []
    if ctx < 1:
        raise CpumlaError("--ctx must be at least 1 (leave it out for min(the model's, 4096))")
    if ctx > trained:
        return [f"--ctx {ctx} is above the {trained} tokens the model was trained for; "
                f"answers past that are unreliable"]
    return []


def check_seed(seed, flag: str = "--seed") -> None:
    if seed is not None and not 0 <= seed < 2 ** 64:
        raise CpumlaError(f"{flag} must be in [0, 2^64), not {seed}")


def dummy_dtypes_help() -> str:
    from cpumla.checkpoint.dummy import DUMMY_DTYPES

    return ", ".join(DUMMY_DTYPES[:-1]) + " or " + DUMMY_DTYPES[-1]


QUANT_HELP = "Quantize the linear layers as they load: q8 (8.5 bits a weight) or q4 (4.5)."


def check_quant(quant) -> None:
    """--quant: None, q8 or q4."""
    from cpumla.checkpoint.formats import QUANTS

    if quant is not None and quant not in QUANTS:
        raise CpumlaError(f"--quant must be one of {', '.join(QUANTS)}, not '{quant}'")
