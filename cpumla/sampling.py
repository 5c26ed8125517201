"""Token sampling over one logits row: greedy, temperature, top-k, top-p, min-p, repetition / presence /
frequency penalties, seeded.

What is sampled (the definition; the native sampler, cpumla_sample, and the numpy code below both
compute exactly this, in exact arithmetic wherever a sum or a threshold is involved):
  x    the logits after the penalties (float32), n of them; m = max x
  p_i  = exp(y_i), y_i = (x_i - m) * s in float32, s = float32(1 / temperature) (the largest float32
       if that overflows). exp is a fixed sequence of float32 operations (_exp: Cody-Waite reduction,
       Cephes' expf polynomial, no fused multiply-adds; within 2 ulp of exp), 0 where y_i < -87,
       at most 1: the top token's p is 1
  w_i  = floor(p_i * 2^S), S = 53 - the bit length of n (36 for 129,280 ids): integer masses, so every
       sum is exact in float64 whatever its order. A token with p_i < 2^-S (under 1.5e-11 of the top
       token's, for 129,280 ids) has no mass and is never drawn
  order: p descending, ties by token id ascending; cum_j = the mass of the first j tokens of it
  kept: the longest prefix allowed by top-k (the first k), top-p (through the first j with
        cum_j >= top_p * W, W the top-k mass, the product in float64) and min-p (p_i >= min_p, real
        comparison); M = the kept prefix's mass, the least of the three
  draw: u = rng.random() (a multiple of 2^-53); the first token of the order with cum_j > u * M
        (a real comparison: (u * 2^53) * M in integers)
temperature 0 is greedy: the first maximal logit, and no draw from rng.

Speed. Sorting the whole vocabulary (129,280 ids) costs 10-20 ms a token, longer than a small model's
decode step, so nothing here sorts it. A prefix is known by its mass: top-p and the draw are both "where
does the cumulative mass cross t", answered from a histogram of p's float32 bits (which order like p)
with only the crossing bin refined. Sampler.choose runs that in C (cpumla.native.sample: well under
a millisecond for any distribution over 129,280 ids); sample_numpy is the same in numpy (the reference
the native one is tested against, and benchmarks/sampling.py's baseline).
"""

from __future__ import annotations

import math

import numpy as np

from cpumla.errors import CpumlaError
from cpumla.native import sample as native_sample

_SHIFT = 16              # bits of a float32 dropped for its bin: 128 bins per octave of p
_NBINS = (0x7F800000 >> _SHIFT) + 1
_EXPLICIT = 4096         # candidate sets up to this size are sorted directly
_Y_MIN = np.float32(-87.0)
_F32_MAX = float(np.finfo(np.float32).max)


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
        self._work, self._work_n = None, 0  # the native sampler's work buffer, for rows of _work_n

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
        x = np.ascontiguousarray(logits, dtype=np.float32).reshape(-1)
        if self.penalised:
            x = self.penalise(x)
        draw = 0 if self.temperature == 0 else draw_of(self.rng.random())
        if self._work is None or self._work_n != x.size:
            self._work, self._work_n = native_sample.work(x.size), x.size
        return native_sample.sample(x, self.temperature, self.top_k, self.top_p, self.min_p, draw, self._work)

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
    check_seed(seed)


def check_seed(seed, name: str = "seed", optional: bool = True) -> None:
    """A seed: an integer in [0, 2^64), or None (random) where optional: the rule of the sampler, the
    dummy weights and the `--seed` option alike."""
    if (seed is not None or not optional) and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer))
                                               or not 0 <= seed < 2 ** 64):
        raise CpumlaError(f"{name} must be in [0, 2^64) and an integer, not {seed!r}")


# ---- the definition in numpy --------------------------------------------------------------------
def draw_of(u: float) -> int:
    """u = rng.random() as the integer u * 2^53 (exact: u is a multiple of 2^-53)."""
    return int(u * 2.0 ** 53)


def _exp(y: np.ndarray) -> np.ndarray:
    """The definition's exp of float32 y <= 0: the float32 steps of the native sampler's sample_exp,
    in its order (numpy's elementwise operations round each step as C does; nothing is fused). In
    place where it can be: fewer temporaries of the row's size."""
    f = np.float32
    yc = np.maximum(y, _Y_MIN)
    k = yc * f(float.fromhex("0x1.715476p+0"))                 # log2(e)
    k += f(12582912.0)                                         # 1.5 * 2^23: round to nearest even
    k -= f(12582912.0)
    r = k * f(float.fromhex("0x1.63p-1"))                      # r = (yc - k ln2_hi) - k ln2_lo
    np.subtract(yc, r, out=r)
    np.multiply(k, f(float.fromhex("-0x1.bd0106p-13")), out=yc)
    r -= yc
    q = r * f(float.fromhex("0x1.a0d2cep-13"))
    for c in ("0x1.6e879cp-10", "0x1.11121p-7", "0x1.555382p-5", "0x1.555554p-3"):
        q += f(float.fromhex(c))
        q *= r
    q += f(0.5)
    np.multiply(r, r, out=yc)
    q *= yc                                                    # e = q * (r * r) + r + 1
    q += r
    q += f(1.0)
    two_k = k.astype(np.int32)
    two_k += 127
    two_k <<= 23
    q *= two_k.view(np.float32)
    np.minimum(q, f(1.0), out=q)
    q[y < _Y_MIN] = 0
    return q


def row_max(x: np.ndarray) -> float:
    """max x, or the CpumlaError a row with NaN, +inf, or nothing but -inf gets."""
    m = float(x.max())                  # NaN anywhere makes the max NaN
    if not math.isfinite(m):
        if math.isnan(m):
            raise CpumlaError("the model's logits contain NaN; no token can be chosen")
        raise CpumlaError("the model's logits are infinite" if m > 0 else "every token's logit is -inf")
    return m


def probs(x: np.ndarray, temperature: float) -> np.ndarray:
    """The definition's p (float32) for the logits row x, temperature > 0."""
    x = np.asarray(x, np.float32).reshape(-1)
    m = row_max(x)
    with np.errstate(over="ignore"):
        s = np.float32(np.float64(1.0) / np.float64(temperature))
    s = min(s, np.float32(_F32_MAX))
    return _exp((x - np.float32(m)) * s)


def mass_shift(n: int) -> int:
    """S: n masses of at most 2^S add up to less than 2^53."""
    return min(52, max(1, 53 - int(n).bit_length()))


def masses(p: np.ndarray) -> np.ndarray:
    """w = floor(p * 2^S) as float64 (integers; exact)."""
    return np.floor(p.astype(np.float64) * 2.0 ** mass_shift(p.size))


def f32_at_least(v: float) -> np.float32:
    """The smallest float32 >= v: p >= v exactly when p >= this."""
    f = np.float32(v)
    return np.nextafter(f, np.float32(np.inf)) if float(f) < v else f


def sample_numpy(x: np.ndarray, temperature: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
                 draw: int = 0) -> int:
    """The definition in numpy (what Sampler.choose computes natively): the token for the logits row
    x (penalties applied) and the integer draw (u * 2^53)."""
    x = np.asarray(x, np.float32).reshape(-1)
    if temperature == 0:
        row_max(x)
        return int(x.argmax())
    return sample(probs(x, temperature), draw, top_k, top_p, min_p)


def _sorted_desc(p: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """ids (ascending) ordered by p descending, then id ascending."""
    v = p[ids]
    if v.size and v.min() == v.max():      # all tied (flat logits): id order already
        return ids
    return ids[np.argsort(-v, kind="stable")]


def sample(p: np.ndarray, draw: int, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> int:
    """The token drawn by u = draw / 2^53 from the definition's p (float32, max 1): the kept prefix of
    the order (p descending, ids ascending) is walked to the first token whose cumulative mass
    exceeds u times the kept prefix's mass."""
    n = p.size
    w = masses(p)
    if top_k and top_k < n:
        # the bin holding the k-th token from the top, and everything above it, sorted: the top k
        bins = (p.view(np.int32) >> _SHIFT).astype(np.intp)
        above = np.cumsum(np.bincount(bins, minlength=_NBINS)[::-1])
        c = _NBINS - 1 - int(np.searchsorted(above, top_k))
        head = _sorted_desc(p, np.flatnonzero(bins >= c))[:top_k]
        keep = head.size
        cum = np.cumsum(w[head])                    # integers below 2^53: exact
        if top_p < 1:
            keep = min(keep, int(np.searchsorted(cum, math.ceil(top_p * cum[-1]))) + 1)
        if min_p > 0:
            keep = min(keep, int(np.count_nonzero(p[head] >= f32_at_least(min_p))))
        t = (draw * int(cum[keep - 1])) >> 53
        return int(head[int(np.searchsorted(cum, t, side="right"))])
    prefix = _Prefix(p, w)
    kept = prefix.total
    if top_p < 1:
        kept = min(kept, prefix.crossing(math.ceil(top_p * prefix.total), "left")[1])
    if min_p > 0:
        kept = min(kept, int(w.sum(where=p >= f32_at_least(min_p))))
    return prefix.crossing((draw * kept) >> 53, "right")[0]


class _Prefix:
    """Cumulative mass along the order (p descending, ids ascending) without sorting the vocabulary.

    crossing(t) finds the first token whose cumulative mass reaches t (an integer). Tokens with mass
    below (total - t) // n hold less than total - t together and come last, so the crossing lies
    above them: for a peaked distribution few tokens remain and are sorted directly. When many remain
    (a flat distribution), float32 bits order like the values: one bincount over the top bits gives
    every bin's mass (exact: integer masses), and only the bin where t is crossed is refined (finer
    bits, then a sort)."""

    def __init__(self, p: np.ndarray, w: np.ndarray):
        self.p, self.w = p, w
        self.keys = p.view(np.int32)
        self.total = int(w.sum())
        self._coarse = None

    def crossing(self, t: int, side: str) -> tuple[int, int]:
        """(token, cumulative mass through it) at the first cumulative > t ("right") or >= t ("left")."""
        p, w, n = self.p, self.w, self.p.size
        cand = np.flatnonzero(w >= max(self.total - t, 0) // n)
        before = 0
        for level, shift in enumerate((19, 11, 3)):
            if cand.size <= _EXPLICIT:
                break
            if level == 0:                      # over everything: shared by every query on this row
                if self._coarse is None:
                    k = (self.keys >> shift).astype(np.intp)    # bincount is slow on int32
                    self._coarse = k, np.cumsum(np.bincount(k, weights=w)[::-1])
                k, above = self._coarse
            else:
                k = (self.keys[cand] >> shift).astype(np.intp)
                k -= int(k.min())
                above = np.cumsum(np.bincount(k, weights=w[cand])[::-1])
            i = int(np.searchsorted(above, t - before, side=side))   # exact sums: a bin with mass
            c = above.size - 1 - i
            if i:
                before += int(above[i - 1])
            cand = np.flatnonzero(k == c) if level == 0 else cand[k == c]
        members = _sorted_desc(p, cand)
        cum = before + np.cumsum(w[members])
        j = int(np.searchsorted(cum, t, side=side))
        return int(members[j]), int(cum[j])
