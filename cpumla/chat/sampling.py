"""Token sampling over one logits row: greedy, temperature, top-k, top-p, min-p, repetition / presence /
frequency penalties, seeded.

What is sampled (the definition; every code path below computes exactly this):
  x   the logits after the penalties (float32)
  p_i = exp((x_i - max x) / temperature) in float32: unnormalised, the top token's is 1
  order: p descending, ties by token id ascending
  kept: the longest prefix of that order allowed by top-k (k first), top-p (the first tokens whose
        mass reaches top_p of the top-k mass) and min-p (p_i >= min_p)
  draw: u = rng.random(); along the kept prefix, the first token whose cumulative p exceeds u times
        the prefix's mass

Speed. Sorting the whole vocabulary (129,280 ids) costs 10-20 ms a token, longer than a small model's
decode step, so nothing here sorts it (the hot path of `cpumla chat`, hence hand-written rather than a
library's sort-based warper). A prefix is known by its mass: top-p and the draw are both "where does the
cumulative mass cross t", answered by `_Prefix` from a histogram of p's float32 bits (which order like
p) with only the crossing bin sorted; top-k sorts only the bins above the k-th token.
"""

from __future__ import annotations

import math

import numpy as np

from cpumla.errors import CpumlaError

_SHIFT = 16              # bits of a float32 dropped for its bin: 128 bins per octave of p
_NBINS = (0x7F800000 >> _SHIFT) + 1
_EXPLICIT = 4096         # candidate sets up to this size are sorted directly


class Sampler:
    def __init__(self, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
                 seed: int | None = None, repeat_penalty: float = 1.0, repeat_last_n: int = 64,
                 presence_penalty: float = 0.0, frequency_penalty: float = 0.0):
        check(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed,
              repeat_penalty=repeat_penalty, repeat_last_n=repeat_last_n, presence_penalty=presence_penalty,
              frequency_penalty=frequency_penalty)
        self.temperature, self.top_k, self.top_p, self.min_p = float(temperature), int(top_k), float(top_p), float(min_p)
        self.repeat_penalty, self.repeat_last_n = float(repeat_penalty), int(repeat_last_n)
        self.presence_penalty, self.frequency_penalty = float(presence_penalty), float(frequency_penalty)
        self.rng = np.random.default_rng(seed)
        self._context: list[int] = []       # the tokens before this answer (the repetition penalty's window)
        self._counts: dict[int, int] = {}   # tokens of this answer and how often each came

    @property
    def penalised(self) -> bool:
        return self.repeat_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def start(self, context_ids=()) -> None:
        """A new answer after context_ids: the repetition penalty looks at the last repeat_last_n tokens
        of the context and the answer; presence and frequency penalties at the answer's tokens."""
        n = self.repeat_last_n
        self._context = [int(t) for t in list(context_ids)[-n:]] if n > 0 else []
        self._counts = {}

    def accept(self, token: int) -> None:
        """Record a generated token (called by __call__ for the token it returns)."""
        self._counts[token] = self._counts.get(token, 0) + 1
        if self.repeat_last_n > 0:
            self._context.append(token)
            if len(self._context) > 2 * self.repeat_last_n:
                del self._context[: -self.repeat_last_n]

    def __call__(self, logits: np.ndarray) -> int:
        tok = self.choose(logits)
        self.accept(tok)
        return tok

    def choose(self, logits: np.ndarray) -> int:
        """The next token for one logits row (the penalties of what was accepted so far applied)."""
        x = np.asarray(logits, dtype=np.float32).reshape(-1)
        if self.penalised:
            x = self.penalise(x)
        m = float(x.max())                  # NaN anywhere makes the max NaN
        if not math.isfinite(m):
            if math.isnan(m):
                raise CpumlaError("the model's logits contain NaN; no token can be chosen")
            raise CpumlaError("the model's logits are infinite" if m > 0 else "every token's logit is -inf")
        if self.temperature == 0:
            return int(x.argmax())
        p = np.exp((x - np.float32(m)) * np.float32(1.0 / self.temperature))
        return sample(p, self.rng.random(), self.top_k, self.top_p, self.min_p)

    def penalise(self, x: np.ndarray) -> np.ndarray:
        """x with the penalties applied (a copy): repetition as llama.cpp (a positive logit divided by
        the penalty, a negative one multiplied), then OpenAI's presence and frequency penalties."""
        x = x.copy()
        if self.repeat_penalty != 1.0 and (self._context or self._counts):
            ids = np.unique(np.asarray(self._context[-self.repeat_last_n:], dtype=np.int64))
            ids = ids[(ids >= 0) & (ids < x.size)]
            v = x[ids]
            x[ids] = np.where(v > 0, v / np.float32(self.repeat_penalty), v * np.float32(self.repeat_penalty))
        if self._counts and (self.presence_penalty or self.frequency_penalty):
            ids = np.fromiter(self._counts, dtype=np.int64, count=len(self._counts))
            counts = np.fromiter(self._counts.values(), dtype=np.float32, count=len(self._counts))
            ok = (ids >= 0) & (ids < x.size)
            x[ids[ok]] -= np.float32(self.frequency_penalty) * counts[ok] + np.float32(self.presence_penalty)
        return x


def check(*, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seed=None, repeat_penalty=1.0, repeat_last_n=64,
          presence_penalty=0.0, frequency_penalty=0.0) -> None:
    """Raises CpumlaError naming the first sampling setting out of range."""
    def finite(name, v):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise CpumlaError(f"{name} must be a finite number, not {v!r}")

    for name, v in (("temperature", temperature), ("top_p", top_p), ("min_p", min_p),
                    ("repeat_penalty", repeat_penalty), ("presence_penalty", presence_penalty),
                    ("frequency_penalty", frequency_penalty)):
        finite(name, v)
    if temperature < 0:
        raise CpumlaError("temperature must be >= 0")
    if not 0 < top_p <= 1:
        raise CpumlaError("top_p must be in (0, 1]")
    if not 0 <= min_p < 1:
        raise CpumlaError("min_p must be in [0, 1)")
    if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or top_k < 0:
        raise CpumlaError("top_k must be an integer >= 0")
    if repeat_penalty <= 0:
        raise CpumlaError("repeat_penalty must be > 0 (1 is off)")
    if isinstance(repeat_last_n, bool) or not isinstance(repeat_last_n, (int, np.integer)) or repeat_last_n < 0:
        raise CpumlaError("repeat_last_n must be an integer >= 0")
    if not -2 <= presence_penalty <= 2 or not -2 <= frequency_penalty <= 2:
        raise CpumlaError("presence_penalty and frequency_penalty must be in [-2, 2]")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer))
                             or not 0 <= seed < 2 ** 64):
        raise CpumlaError(f"seed must be an integer in [0, 2^64), not {seed!r}")


# ---- the selection --------------------------------------------------------------------------------
def _sorted_desc(p: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """ids (ascending) ordered by p descending, then id ascending."""
    v = p[ids]
    if v.size and v.min() == v.max():      # all tied (flat logits): id order already
        return ids
    return ids[np.argsort(-v, kind="stable")]


def sample(p: np.ndarray, u: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> int:
    """The token drawn by u in [0, 1) from unnormalised probabilities p (float32, max 1): the kept
    prefix of the order (p descending, ids ascending) is walked in that order to the first token whose
    cumulative p exceeds u times the kept prefix's mass."""
    n = p.size
    floor = np.float32(min_p)
    if top_k and top_k < n:
        # the bin holding the k-th token from the top, and everything above it, sorted: the top k
        bins = (p.view(np.int32) >> _SHIFT).astype(np.intp)
        above = np.cumsum(np.bincount(bins, minlength=_NBINS)[::-1])
        c = _NBINS - 1 - int(np.searchsorted(above, top_k))
        head = _sorted_desc(p, np.flatnonzero(bins >= c))[:top_k]
        keep = head.size
        cum = np.cumsum(p[head].astype(np.float64))
        if top_p < 1:
            keep = min(keep, int(np.searchsorted(cum, top_p * cum[-1])) + 1)
        if min_p > 0:
            keep = min(keep, int(np.count_nonzero(p[head] >= floor)))
        j = int(np.searchsorted(cum[:keep], u * cum[keep - 1], side="right"))
        return int(head[min(j, keep - 1)])
    prefix = _Prefix(p)
    kept = prefix.total
    if top_p < 1:
        kept = min(kept, prefix.crossing(top_p * prefix.total, "left")[1])
    if min_p > 0:
        kept = min(kept, float(p.sum(dtype=np.float64, where=p >= floor)))
    return prefix.crossing(u * kept, "right")[0]


class _Prefix:
    """Cumulative mass along the order (p descending, ids ascending) without sorting the vocabulary.

    crossing(t) finds the first token whose cumulative mass reaches t. Tokens with p below
    (total - t) / n hold less than total - t together, so the crossing lies above them: for a peaked
    distribution few tokens remain and are sorted directly. When many remain (a flat distribution),
    float32 bits order like the values: one bincount over the top bits gives every bin's mass, and only
    the bin where t is crossed is refined (finer bits, then a sort)."""

    def __init__(self, p: np.ndarray):
        self.p = p
        self.keys = p.view(np.int32)
        self.total = float(p.sum(dtype=np.float64))
        self._coarse = None

    def crossing(self, t: float, side: str) -> tuple[int, float]:
        """(token, cumulative mass through it) at the first cumulative > t ("right") or >= t ("left")."""
        p, n = self.p, self.p.size
        cand = np.flatnonzero(p >= np.float32(max(self.total - t, 0.0) / n))
        before = 0.0
        for level, shift in enumerate((19, 11, 3)):
            if cand.size <= _EXPLICIT:
                break
            if level == 0:                      # over everything: shared by every query on this row
                if self._coarse is None:
                    k = (self.keys >> shift).astype(np.intp)    # bincount is slow on int32
                    self._coarse = k, np.cumsum(np.bincount(k, weights=p)[::-1])
                k, above = self._coarse
            else:
                k = (self.keys[cand] >> shift).astype(np.intp)
                k -= int(k.min())
                above = np.cumsum(np.bincount(k, weights=p[cand])[::-1])
            i = min(int(np.searchsorted(above, t - before, side=side)), above.size - 1)
            while i and above[i] == above[i - 1]:     # rounding ran past the last non-empty bin
                i -= 1
            c = above.size - 1 - i
            if i:
                before += float(above[i - 1])
            cand = np.flatnonzero(k == c) if level == 0 else cand[k == c]
        members = _sorted_desc(p, cand)
        cum = before + np.cumsum(p[members].astype(np.float64))
        j = min(int(np.searchsorted(cum, t, side=side)), members.size - 1)
        return int(members[j]), float(cum[j])
