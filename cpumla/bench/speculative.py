"""`cpumla bench` for speculative decoding: what verifying n tokens in one forward costs against one,
next to the bytes it reads (C(n), runtime/speculative.py), and decode when every draft is kept (a test
hook: random weights keep almost none), next to the bound the bytes set: with every draft kept, K drafts
give K+1 tokens for C(K+1) + K d decode steps' bytes, (K+1) / (C(K+1) + K d) times plain decode."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from cpumla import native
from cpumla.runtime.speculative import bytes_ratio, draft_ratio


@dataclass
class SpecResult:
    n_threads: int
    n_depth: int
    test: str             # "verify N" or "tg accept-all K=.."
    ms: float             # mean milliseconds of one forward (verify) or one token (decode)
    ratio: float          # verify: time(n) / time(1); decode: tok/s over plain decode's, same run
    bound: float          # verify: C(n); decode: (K+1) / (C(K+1) + K d)
    tokens_per_s: float = 0.0

    @property
    def of_bound(self) -> float:
        """verify: time ratio over the bytes ratio (1.0: as bandwidth-bound as one token); decode: the
        share of the byte bound reached."""
        return self.ratio / self.bound if self.bound else 0.0


def run(eng, at_depth, threads: list[int], depths: list[int], reps: int, k: int, rng, steps: int = 32):
    """Yields SpecResult: per thread count and depth, verify n = 2 .. k+1 against 1 (alternating within
    each repetition), then decode with every draft kept against plain decode (alternating)."""
    V = eng.config.vocab_size
    drafter = eng.drafter
    p_min = getattr(drafter, "p_min", None)
    if p_min is not None:
        drafter.p_min = 0.0             # the hook: every draft proposed, every draft kept
    try:
        for t in threads:
            native.set_threads(t)
            for d in depths:
                times = {n: [] for n in range(1, k + 2)}
                for rep in range(reps + 1):
                    for n in times:
                        at_depth(d)
                        ids = rng.integers(0, V, size=n)
                        t0 = time.perf_counter_ns()
                        eng.forward(ids, last_only=n == 1)
                        if rep:
                            times[n].append(time.perf_counter_ns() - t0)
                base = float(np.mean(times[1]))
                for n in range(2, k + 2):
                    ms = float(np.mean(times[n]))
                    yield SpecResult(t, d, f"verify {n}", ms / 1e6, ms / base, bytes_ratio(eng, n, d))
                plain, spec = [], []
                for rep in range(reps + 1):
                    at_depth(d)
                    t0 = time.perf_counter_ns()
                    for tok in rng.integers(0, V, size=steps):
                        eng.forward([int(tok)], last_only=True)
                    if rep:
                        plain.append((time.perf_counter_ns() - t0) / steps)
                    at_depth(d)
                    made, t0 = 0, time.perf_counter_ns()
                    tok = int(rng.integers(0, V))
                    while made < steps:
                        drafts = drafter.draft(tok, k) if drafter is not None else []
                        if len(drafts) < k:                       # ngram found none: random drafts
                            drafts += rng.integers(0, V, size=k - len(drafts)).tolist()
                        eng.forward([tok] + drafts)
                        made += k + 1
                        tok = int(rng.integers(0, V))
                    if rep:
                        spec.append((time.perf_counter_ns() - t0) / made)
                p_ns, s_ns = float(np.mean(plain)), float(np.mean(spec))
                dr = draft_ratio(eng, d) if eng.draft == "mtp" else 0.0
                bound = (k + 1) / (bytes_ratio(eng, k + 1, d) + k * dr)
                yield SpecResult(t, d, f"tg accept-all K={k}", s_ns / 1e6, p_ns / s_ns, bound, 1e9 / s_ns)
    finally:
        if p_min is not None:
            drafter.p_min = p_min
        native.set_threads(None)


def rows(results: list[SpecResult], draft: str) -> list[list[str]]:
    """Table rows: test, threads, depth, time, against one token / plain decode, the byte bound."""
    out = []
    for r in results:
        if r.test.startswith("verify"):
            out.append([r.test, str(r.n_threads), str(r.n_depth), f"{r.ms:.2f} ms",
                        f"{r.ratio:.2f}x one token's time", f"C(n) {r.bound:.2f}: {r.of_bound:.2f}x the bytes ratio"])
        else:
            out.append([f"{r.test} ({draft})", str(r.n_threads), str(r.n_depth), f"{r.tokens_per_s:.1f} t/s",
                        f"{r.ratio:.2f}x plain decode", f"bound {r.bound:.2f}x: {100 * r.of_bound:.0f}% of it"])
    return out


def as_dict(r: SpecResult) -> dict:
    return {"test": r.test, "n_threads": r.n_threads, "n_depth": r.n_depth, "ms": r.ms, "ratio": r.ratio,
            "bound": r.bound, "of_bound": r.of_bound, "tokens_per_s": r.tokens_per_s}

