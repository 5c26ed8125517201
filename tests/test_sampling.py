"""The sampler against float64 references written apart from it: distributions (chi-square over many
draws for a fixed seed), the exact kept set and token for every draw against a full sort, the
penalties, stop strings, NaN and range errors."""

from __future__ import annotations

import math

import numpy as np
import pytest

from cpumla.chat import sampling as S
from cpumla.chat.stops import StopText, parse_stop
from cpumla.errors import CpumlaError


def reference_probs(logits, temperature, top_k=0, top_p=1.0, min_p=0.0):
    """float64, by a full sort: the distribution the sampler must draw from."""
    z = np.asarray(logits, np.float64) / temperature
    order = np.argsort(-z, kind="stable")
    p = np.exp(z[order] - z[order[0]])
    keep = len(p) if not top_k else min(top_k, len(p))
    if top_p < 1:
        keep = min(keep, int(np.searchsorted(np.cumsum(p[:keep]) / p[:keep].sum(), top_p)) + 1)
    if min_p > 0:
        keep = min(keep, int((p[:keep] >= min_p).sum()))
    out = np.zeros(len(p))
    out[order[:keep]] = p[:keep] / p[:keep].sum()
    return out


def reference_token(p32, u, top_k=0, top_p=1.0, min_p=0.0):
    """The documented definition, by a full sort of the float32 p the sampler computes."""
    order = np.lexsort((np.arange(p32.size), -p32))
    keep = p32.size if not top_k else min(top_k, p32.size)
    cum = np.cumsum(p32[order[:keep]].astype(np.float64))
    if top_p < 1:
        keep = min(keep, int(np.searchsorted(cum, top_p * cum[-1])) + 1)
    if min_p > 0:
        keep = min(keep, int((p32[order[:keep]] >= np.float32(min_p)).sum()))
    j = int(np.searchsorted(cum[:keep], u * cum[keep - 1], side="right"))
    return int(order[min(j, keep - 1)])


CASES = [dict(temperature=1.0), dict(temperature=0.7, top_p=0.8), dict(temperature=1.3, top_k=7),
         dict(temperature=0.9, min_p=0.1), dict(temperature=0.8, top_k=20, top_p=0.9, min_p=0.02)]


@pytest.mark.parametrize("kw", CASES)
def test_distribution_chi_square(kw):
    rng = np.random.default_rng(5)
    logits = (rng.standard_normal(40) * 1.5).astype(np.float32)
    want = reference_probs(logits, **kw)
    s = S.Sampler(seed=11, **kw)
    draws = 20000
    counts = np.bincount([s.choose(logits) for _ in range(draws)], minlength=logits.size)
    assert counts[want == 0].sum() == 0                      # nothing outside the kept set, ever
    live = want > 0
    expected = want[live] * draws
    chi2 = float(((counts[live] - expected) ** 2 / expected).sum())
    dof = int(live.sum()) - 1
    # the 99.9% quantile of chi-square (Wilson-Hilferty); a fixed seed makes the test deterministic
    z = 3.09
    limit = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3 if dof > 0 else 0.0
    assert chi2 <= max(limit, 1e-9), (chi2, limit)


@pytest.mark.parametrize("scale", [0.01, 1.0, 4.0, 30.0])
@pytest.mark.parametrize("kw", [dict(top_p=0.95), dict(top_k=40), dict(), dict(min_p=0.05),
                                dict(top_k=5000, top_p=0.9), dict(top_p=0.5, min_p=0.2)])
def test_full_vocabulary_tokens_equal_a_full_sort(scale, kw, monkeypatch):
    """Every draw on a 129,280-id row is the token a full sort gives, whichever path finds it (the
    direct sort of a few candidates, or the bit histograms when many remain)."""
    rng = np.random.default_rng(int(scale * 100) + len(kw))
    x = (rng.standard_normal(129280) * scale).astype(np.float32)
    x[rng.integers(0, x.size, 500)] = x.max()                # ties at the top
    p = np.exp((x - x.max()) * np.float32(1 / 0.7))
    us = rng.random(8)
    want = [reference_token(p, u, **kw) for u in us]
    assert [S.sample(p, u, **kw) for u in us] == want
    monkeypatch.setattr(S, "_EXPLICIT", 1)                   # force the histograms on every query
    assert [S.sample(p, u, **kw) for u in us] == want
    monkeypatch.setattr(S, "_EXPLICIT", 10 ** 6)             # and a direct sort
    assert [S.sample(p, u, **kw) for u in us] == want


def test_seeded_and_greedy():
    x = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    a = [S.Sampler(temperature=0.8, top_p=0.9, seed=3).choose(x) for _ in range(3)]
    assert len(set(a)) == 1
    assert S.Sampler(temperature=0).choose(x) == int(np.argmax(x))


def test_penalties():
    x = np.array([2.0, -1.0, 1.9, 0.0], np.float32)
    s = S.Sampler(temperature=0, repeat_penalty=2.0)
    s.start([0, 1])
    y = s.penalise(x)
    assert y[0] == 1.0 and y[1] == -2.0 and y[2] == np.float32(1.9) and y[3] == 0.0
    assert s.choose(x) == 2                                  # the repeated top token lost its lead
    s = S.Sampler(temperature=0, presence_penalty=0.5, frequency_penalty=0.25)
    s.start([0])                                             # the prompt does not count for these
    assert s.choose(x) == 0
    s.accept(0)
    s.accept(0)
    assert s.penalise(x)[0] == np.float32(2.0 - 0.5 - 2 * 0.25) and s.choose(x) == 2
    s = S.Sampler(temperature=0, repeat_penalty=1.5, repeat_last_n=1)
    s.start([0, 3])                                          # only the last token is in the window
    assert s.penalise(x)[0] == 2.0


def test_nan_and_bad_settings_are_one_line_errors():
    x = np.zeros(10, np.float32)
    x[3] = np.nan
    for t in (0.0, 0.7):
        with pytest.raises(CpumlaError, match="NaN"):
            S.Sampler(temperature=t).choose(x)
    with pytest.raises(CpumlaError, match="-inf"):
        S.Sampler(temperature=0.5).choose(np.full(4, -np.inf, np.float32))
    for kw in (dict(temperature=float("nan")), dict(temperature=-1), dict(top_p=0), dict(top_p=float("nan")),
               dict(min_p=1), dict(top_k=-1), dict(seed=-1), dict(repeat_penalty=0),
               dict(presence_penalty=3), dict(frequency_penalty=float("inf")), dict(repeat_last_n=-2)):
        with pytest.raises(CpumlaError):
            S.Sampler(**kw)


def test_stop_text_holds_back_and_cuts():
    st = StopText(["</end>", "\n\n"])
    out = [st.push(t) for t in ["Hello", " wor", "ld</", "en", "d> more"]]
    assert "".join(out) == "Hello world" and st.hit == "</end>"
    assert out[2] == "ld" and st.push("x") == "" and st.flush() == ""
    st = StopText(["STOP"])
    assert st.push("ST") == "" and st.flush() == "ST" and st.hit is None
    st = StopText(["a\nb"])
    assert st.push("xa\n") == "x" and st.push("c") == "a\nc"
    assert parse_stop("off") == () and parse_stop("\\n\\n") == ("\n\n",)
    with pytest.raises(CpumlaError):
        parse_stop([""])
