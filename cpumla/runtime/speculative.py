"""Speculative decoding: a drafter proposes the next K tokens, one forward of K+1 tokens verifies them
(each weight read once for all of them), and the tokens the sampler would have picked anyway are kept.

How a decode loop uses it (Engine.stepper()): it samples a token from a logits row as always and asks
the stepper for the next row, `row = step(tok)`. The stepper either hands out a row it already has (tok
is the draft it verified: that position is in the cache already) or rolls the cache back to tok's
position and runs a forward of [tok, drafts...]. Every token is still sampled by the caller's own
sampler from the model's own logits at its position, one at a time, penalties, constraints and seed
included, so the output is the model's exactly: greedy text is the text without drafts, and a sampled
token is drawn from the same distribution with the same random numbers (speculative sampling with a
draft that is a point mass: the draft d is kept with probability p(d), and on a miss the sampled token
is the correction). The drafts only decide how many positions one forward computes. `close()` rolls
back what was verified but not consumed, so the cache holds exactly the tokens handed to the stepper.

Drafters:
- MtpDrafter: the checkpoint's multi-token-prediction layer (V3 / R1 / V3.1 / V3.2 / V4). Its cache
  holds one entry per position i: (the main model's hidden state h_i, token i+1; V4: the residual
  streams before the HyperHead). The main forward
  hands it every hidden row; entries are written lazily, when a draft is asked for, over the positions
  accepted since (so rejected positions never cost an MTP pass); a long prefill writes them chunk by
  chunk. Chained drafts (K > 1) feed the layer's own output back as the hidden input. A draft whose
  top probability under the MTP layer is below `p_min` is not proposed. By default p_min is where a
  draft starts to pay, by the bytes: verifying one draft reads C(2) + d decode steps' bytes for 1 + a
  tokens (a: the chance it is kept, estimated by its probability), so a draft pays when a > C(2) + d - 1.

Bytes, on a bandwidth-bound machine: n tokens in one forward read the dense weights once and the union
of their routed experts, E (1 - (1 - k/E)^n) per MoE layer with independent routing (an upper bound);
C(n) is that over one token's bytes. A draft step reads d of a decode step's bytes (the MTP layer: its
projections, one layer with top-k experts, the head).
- NgramDrafter: prompt lookup: the continuation of the latest earlier occurrence of the last few
  tokens (4 down to 2), for answers that quote or edit their context.
"""

from __future__ import annotations

import os

import numpy as np

from cpumla.errors import CpumlaError
from cpumla.models import PREFILL_CHUNK

DRAFTS = ("mtp", "ngram", "none")
MAX_DRAFT_TOKENS = 8
P_MIN_RANGE = (0.05, 0.95)     # the default p_min (where a draft pays by the bytes) is kept within this


def check_draft(mode, k, p_min=None) -> None:
    """CpumlaError naming a bad draft setting (p_min None: the default)."""
    if mode is not None and mode not in DRAFTS:
        raise CpumlaError(f"draft must be one of {', '.join(DRAFTS)}, not {mode!r}")
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k <= MAX_DRAFT_TOKENS:
        raise CpumlaError(f"draft tokens must be an integer from 1 to {MAX_DRAFT_TOKENS}, not {k!r}")
    if p_min is not None and (isinstance(p_min, bool) or not isinstance(p_min, (int, float)) or not 0 <= p_min <= 1):
        raise CpumlaError(f"the draft's minimum probability must be in [0, 1], not {p_min!r}")


def mtp_source(mode, draft_model=None):
    """Where a GGUF model's MTP layer comes from when its file has none (resolve_model's mtp): draft_model,
    an MTP file anywhere (llama.cpp's `-md`), drafting with mtp; else the MTP file beside the model
    (None), unless the drafts are ngram or none (False: no file opened, a bad one in the way of
    nothing). CpumlaError for draft_model with another mode."""
    if draft_model is None:
        return False if mode in ("ngram", "none") else None
    if isinstance(draft_model, bool) or not isinstance(draft_model, (str, os.PathLike)) or not str(draft_model):
        raise CpumlaError(f"draft_model must be the path of an MTP GGUF file, not {draft_model!r}")
    if mode not in (None, "mtp"):
        raise CpumlaError(f"--draft-model drafts with the MTP layer it holds: not with --draft {mode}")
    return os.fspath(draft_model)


def expert_union(k: int, E: int, n: int) -> float:
    """Expected distinct experts n tokens route to, k of E each, independently."""
    return E * (1 - (1 - k / E) ** n)


def bytes_ratio(eng, n: int, depth: int) -> float:
    """C(n): bytes a forward of n tokens reads over one token's (dense once, the experts' union)."""
    cfg, model = eng.config, eng.model
    one = model.decode_bytes(depth)
    k, E = getattr(cfg, "num_experts_per_tok", 0) or 0, getattr(cfg, "n_routed_experts", 0) or 0
    routed = model.routed_tables()
    if eng.has_mtp:
        routed = routed[:-1]                 # the MTP layer's experts are the draft's, not the forward's
    if not k or not E or not routed:
        return 1.0
    per_token = len(routed) * routed[0].expert_bytes * k
    return (one - per_token + per_token * expert_union(k, E, n) / k) / one


def draft_ratio(eng, depth: int) -> float:
    """d: an MTP draft step's bytes over a decode step's."""
    return eng.model.mtp_bytes() / eng.model.decode_bytes(depth) if eng.has_mtp else 0.0


def default_p_min(eng) -> float:
    """Where an MTP draft pays by the bytes: C(2) + d - 1, within P_MIN_RANGE."""
    lo, hi = P_MIN_RANGE
    return min(hi, max(lo, bytes_ratio(eng, 2, 0) + draft_ratio(eng, 0) - 1))


def top_prob(logits: np.ndarray) -> tuple[int, float]:
    """(argmax, its softmax probability) of one logits row."""
    i = int(np.argmax(logits))
    x = logits.astype(np.float64) - float(logits[i])
    return i, float(1.0 / np.exp(x).sum())


class MtpDrafter:
    """Drafts with the model's MTP layer (models' mtp_forward). Holds the main model's normed hidden
    rows of positions [done, done + len(rows)), the MTP entries of positions below `done` written."""

    def __init__(self, eng, p_min: float | None = None):
        self.eng = eng
        self.p_min = default_p_min(eng) if p_min is None else float(p_min)
        self.model = eng.model
        self.D = eng.model.mtp_width          # what the layer takes of a position (V4: its N streams)
        self.done = 0
        # the rows, preallocated: one verify forward's (K+1) on top of the rows kept between drafts
        self._buf = np.empty((PREFILL_CHUNK + MAX_DRAFT_TOKENS + 1, self.D), np.float32)
        self._n = 0

    @property
    def rows(self) -> np.ndarray:
        return self._buf[:self._n]

    # ---- kept in step with the engine's cache (Engine calls these under its lock) ----
    def after_forward(self, pos0: int, hidden: np.ndarray, ids_at) -> None:
        """The main forward wrote positions pos0.. (hidden: their normed states); ids_at(a, b): the
        cache's token ids of positions a .. b-1 (asked only when entries are written here)."""
        self.truncated(pos0)
        m = len(hidden)
        if self._n + m <= len(self._buf):
            self._buf[self._n:self._n + m] = hidden
            self._n += m
            return
        # a long prefill, or plain decode that never drafts: write all but the newest entry now
        rows = np.concatenate([self.rows, hidden])
        n = len(rows) - 1
        for c0 in range(0, n, PREFILL_CHUNK):
            c1 = min(n, c0 + PREFILL_CHUNK)
            ids = np.asarray(ids_at(self.done + c0 + 1, self.done + c1 + 1), np.int64)
            self.model.mtp_forward(ids, self.done + c0, rows[c0:c1], None, True)
        self.done += n
        self._buf[0] = rows[-1]
        self._n = 1

    def truncated(self, n: int) -> None:
        """The cache now holds n tokens."""
        if n < self.done:
            self.done, self._n = n, 0
        else:
            self._n = min(self._n, n - self.done)

    # ---- drafting ----
    def draft(self, tok: int, k: int) -> list[int]:
        """Up to k tokens to follow tok (tok is the next token, not in the cache yet)."""
        eng = self.eng
        pos = eng.pos
        if self.done + len(self.rows) != pos or not len(self.rows):
            return []             # the hidden rows do not cover the cache (never expected): no draft
        ids = np.asarray(eng.tokens[self.done + 1:pos] + [tok], np.int64)
        logits = np.empty((1, eng.config.vocab_size), np.float32)
        h_out = np.empty((1, self.D), np.float32)          # last_only: the last position's alone
        self.model.mtp_forward(ids, self.done, self.rows, logits, True, h_out)
        self.done, self._n = pos, 0
        out: list[int] = []
        while True:
            d, p = top_prob(logits[0])
            if p < self.p_min:
                break
            out.append(d)
            if len(out) >= k:
                break
            # chain: the layer's output as the hidden input, at the next position (an entry that the
            # next catch-up overwrites with the real one)
            h, h_out = h_out, np.empty((1, self.D), np.float32)
            self.model.mtp_forward(np.asarray([d], np.int64), pos + len(out) - 1, h, logits, True, h_out)
        return out


class NgramDrafter:
    """Prompt lookup: after the last `n` tokens (n from 4 down to 2), the tokens that followed their
    latest earlier occurrence in the cache."""

    def __init__(self, eng, sizes=(4, 3, 2)):
        self.eng, self.sizes = eng, sizes

    def draft(self, tok: int, k: int) -> list[int]:
        seq = self.eng.tokens + [tok]
        arr = np.asarray(seq, np.int64)
        for n in self.sizes:
            if len(seq) <= n:
                continue
            tail = arr[-n:]
            # windows starting before the tail itself, newest first
            win = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)
            hits = np.flatnonzero((win == tail).all(axis=1))
            if len(hits):
                start = int(hits[-1]) + n
                out = seq[start:start + k]
                if out:
                    return out
        return []


class Stepper:
    """One decode loop's view of the engine: step(tok) -> the logits row [vocab] after tok. See the
    module's doc."""

    def __init__(self, eng, drafter=None, k: int = 1):
        self.eng, self.drafter, self.k = eng, drafter, k
        self.queue: list[tuple[int, np.ndarray]] = []    # (draft, the row after it), verified ahead
        self.at = eng.pos                                 # where the next token goes
        self.verified = self.accepted = self.forwards = 0
        self._mine = eng.epoch                            # the cache as this stepper left it

    def __call__(self, tok: int) -> np.ndarray:
        eng = self.eng
        if eng.epoch != self._mine:          # someone else changed the cache: start from it as it is
            self.queue, self.at = [], eng.pos
        if self.queue:
            d, row = self.queue.pop(0)
            if d == tok:
                self.at += 1
                self.accepted += 1
                return row
            self.queue = []
        if eng.pos != self.at:
            eng.truncate(self.at)
        drafts = []
        if self.drafter is not None:
            room = eng.max_seq_len - eng.pos - 1
            if room > 0:
                drafts = self.drafter.draft(tok, min(self.k, room))
        self.forwards += 1
        logits = eng.forward([tok] + drafts, last_only=not drafts)
        self._mine = eng.epoch
        self.at += 1
        self.verified += len(drafts)
        self.queue = list(zip(drafts, logits[1:]))
        return logits[0]

    def close(self) -> None:
        """Forgets the verified drafts not consumed: the cache ends at the last token stepped (unless
        someone else has changed it since: theirs stands)."""
        self.queue = []
        if self.eng.epoch == self._mine and self.eng.pos > self.at:
            self.eng.truncate(self.at)
            self._mine = self.eng.epoch

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
