"""`cpumla bench` under tensor parallel (--tp N, or torchrun): what the ranks' talk costs. The
all-reduce of one decode token's hidden state (D float32) timed alone, p50 and p99 over many calls, and
the communication time inside decode tokens (rank 0's all-reduces, logit gather and command
broadcasts, waits included), next to the token's time."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np


@dataclass
class TpResult:
    ranks: int
    transport: str            # "shared memory" or "gloo"
    threads: int              # rank 0's (every rank gets its slice of the CPUs)
    floats: int               # the all-reduce probe's size: one token's hidden state
    p50_us: float
    p99_us: float
    token_ms: float           # one decode token, mean
    comm_ms: float            # of which rank 0 spent communicating, mean
    calls_per_token: float    # all-reduces + gathers + broadcasts a token


def run(eng, at_depth, threads: int, tokens: int = 32, iters: int = 400, rng=None) -> TpResult:
    """The probe (after a warm-up of iters / 4 calls), then `tokens` decode tokens at depth 0."""
    model, ranks = eng.model, eng.ranks
    D = eng.config.hidden_size
    model.probe(D, max(1, iters // 4))
    lat = np.array(model.probe(D, iters)) * 1e6
    rng = rng or np.random.default_rng(0)
    at_depth(0)
    eng.forward([int(rng.integers(0, eng.config.vocab_size))])
    ranks.comm.reset_stats()
    t0 = time.perf_counter()
    for _ in range(tokens):
        eng.forward([int(rng.integers(0, eng.config.vocab_size))])
    dt = time.perf_counter() - t0
    st = ranks.comm.stats()
    calls = st["all_reduces"] + st["gathers"] + st["broadcasts"]
    return TpResult(ranks.world, "shared memory" if ranks.local else "gloo", threads, D,
                    float(np.percentile(lat, 50)), float(np.percentile(lat, 99)), 1e3 * dt / tokens,
                    1e3 * st["seconds"] / tokens, calls / tokens)


def line(r: TpResult) -> str:
    return (f"tensor parallel: {r.ranks} ranks over {r.transport}, {r.threads} threads each; all-reduce of one "
            f"token's hidden state ({r.floats} floats) p50 {r.p50_us:.1f} us, p99 {r.p99_us:.1f} us; a decode token "
            f"{r.token_ms:.2f} ms, of which {r.comm_ms:.2f} ms ({100 * r.comm_ms / max(r.token_ms, 1e-9):.0f}%) "
            f"in {r.calls_per_token:.0f} exchanges with the other ranks, waits included")


def as_dict(r: TpResult) -> dict:
    return {"test": "tp", **r.__dict__}
