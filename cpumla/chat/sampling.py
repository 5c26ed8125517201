"""Token sampling: greedy, temperature, top-k, top-p, min-p, seeded. Runs on one logits row."""

from __future__ import annotations

import numpy as np

from cpumla.errors import CpumlaError


class Sampler:
    def __init__(self, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
                 seed: int | None = None):
        if temperature < 0:
            raise CpumlaError("temperature must be >= 0")
        if not 0 < top_p <= 1:
            raise CpumlaError("top_p must be in (0, 1]")
        if not 0 <= min_p < 1:
            raise CpumlaError("min_p must be in [0, 1)")
        if top_k < 0:
            raise CpumlaError("top_k must be >= 0")
        self.temperature, self.top_k, self.top_p, self.min_p = temperature, top_k, top_p, min_p
        self.rng = np.random.default_rng(seed)

    def __call__(self, logits: np.ndarray) -> int:
        if self.temperature == 0:
            return int(np.argmax(logits))
        z = logits.astype(np.float64) / self.temperature
        order = np.argsort(-z, kind="stable")
        if self.top_k:
            order = order[: self.top_k]
        p = np.exp(z[order] - z[order[0]])
        p /= p.sum()
        keep = len(p)
        if self.top_p < 1:
            keep = min(keep, int(np.searchsorted(np.cumsum(p), self.top_p) + 1))
        if self.min_p > 0:
            keep = min(keep, max(1, int((p >= self.min_p * p[0]).sum())))
        p = p[:keep] / p[:keep].sum()
        return int(order[self.rng.choice(keep, p=p)])
