"""The sampler against references written apart from it: distributions (chi-square over many draws for a
fixed seed, against float64 softmaxes), the exact token for every draw against the documented
definition by a full sort (native at every instruction-set level, and the numpy path), the defined exp
bit for bit, the penalties, stop strings, NaN and range errors."""

from __future__ import annotations

import math

import numpy as np
import pytest

from cpumla import sampling as S
from cpumla.chat.stops import StopText, parse_stop
from cpumla.errors import CpumlaError
from cpumla.native import sample as native_sample


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


def reference_token(p32, draw, top_k=0, top_p=1.0, min_p=0.0):
    """The documented definition, by a full sort of the float32 p (S.probs) in exact integers."""
    order = np.lexsort((np.arange(p32.size), -p32))
    w = [int(v) for v in S.masses(p32)[order]]
    cum = np.cumsum(np.array(w, dtype=object))              # Python ints: exact whatever the size
    keep = p32.size if not top_k else min(top_k, p32.size)
    if top_p < 1:
        t = math.ceil(top_p * float(cum[keep - 1]))
        keep = min(keep, next(j for j in range(keep) if cum[j] >= t) + 1)
    if min_p > 0:
        keep = min(keep, int((p32[order[:keep]].astype(np.float64) >= min_p).sum()))
    t = (draw * int(cum[keep - 1])) >> 53
    return int(order[next(j for j in range(keep) if cum[j] > t)])


CASES = [dict(temperature=1.0), dict(temperature=0.7, top_p=0.8), dict(temperature=1.3, top_k=7),
         dict(temperature=0.9, min_p=0.1), dict(temperature=0.8, top_k=20, top_p=0.9, min_p=0.02)]


def chi_square_ok(counts, want, draws):
    """counts against draws * want: nothing outside the support, and chi-square below its 99.9%
    quantile (Wilson-Hilferty); a fixed seed makes the test deterministic."""
    assert counts[want == 0].sum() == 0                      # nothing outside the kept set, ever
    live = want > 0
    expected = want[live] * draws
    chi2 = float(((counts[live] - expected) ** 2 / expected).sum())
    dof = int(live.sum()) - 1
    z = 3.09
    limit = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3 if dof > 0 else 0.0
    assert chi2 <= max(limit, 1e-9), (chi2, limit)


@pytest.mark.parametrize("kw", CASES)
def test_distribution_chi_square(kw):
    rng = np.random.default_rng(5)
    logits = (rng.standard_normal(40) * 1.5).astype(np.float32)
    want = reference_probs(logits, **kw)
    s = S.Sampler(seed=11, **kw)
    draws = 20000
    counts = np.bincount([s.choose(logits) for _ in range(draws)], minlength=logits.size)
    chi_square_ok(counts, want, draws)


@pytest.mark.parametrize("kw", [dict(temperature=0.7, top_k=40), dict(temperature=1.0, top_p=0.9, min_p=0.01)])
def test_full_vocabulary_chi_square(kw):
    """The native path on a 129,280-id row: a peaked head over a flat tail of near-zero mass."""
    rng = np.random.default_rng(8)
    x = (rng.standard_normal(129280) * 0.3 - 12).astype(np.float32)
    x[rng.choice(x.size, 60, replace=False)] = (rng.standard_normal(60) * 1.5).astype(np.float32)
    want = reference_probs(x, **kw)
    s = S.Sampler(seed=12, **kw)
    draws = 6000
    counts = np.bincount([s.choose(x) for _ in range(draws)], minlength=x.size)
    chi_square_ok(counts, want, draws)


def test_equal_logits_chi_square():
    """Flat logits: every id equally likely (ties are broken by id in the order, not in the draw)."""
    s = S.Sampler(temperature=0.8, seed=4)
    x = np.zeros(50, np.float32)
    draws = 20000
    chi_square_ok(np.bincount([s.choose(x) for _ in range(draws)], minlength=50), np.full(50, 0.02), draws)


# ---- native == numpy == the definition by a full sort ---------------------------------------------
def _row(kind: str) -> np.ndarray:
    rng = np.random.default_rng(abs(hash(kind)) % 2 ** 32)
    n = 129280
    if kind == "equal":
        return np.full(n, 0.25, np.float32)
    if kind == "two-values":                    # a few on top, every other logit equal
        x = np.full(n, -1.0, np.float32)
        x[rng.integers(0, n, 5)] = 0.5
        return x
    scale = {"flat": 0.001, "dummy": 0.05, "normal": 1.0, "wide": 4.0, "peaked": 30.0}[kind]
    x = (rng.standard_normal(n) * scale).astype(np.float32)
    x[rng.integers(0, n, 300)] = x.max()                    # ties at the top
    x[rng.integers(0, n, 300)] = -np.inf
    return x


KINDS = ("equal", "two-values", "flat", "dummy", "normal", "wide", "peaked")
SETTINGS = [dict(), dict(top_k=1), dict(top_k=40), dict(top_p=0.9), dict(min_p=0.05),
            dict(top_k=5000, top_p=0.9, min_p=0.01), dict(top_p=0.5, min_p=0.2), dict(top_k=129280)]
TEMPERATURES = (0.1, 0.7, 2.0)
_reference_cache: dict = {}


def _draws(kind, t):
    rng = np.random.default_rng(int(t * 10) + len(kind))
    return [0, (1 << 53) - 1] + [int(d) for d in rng.integers(0, 1 << 53, 4)]


def _reference(kind, t):
    """{(settings index, draw): token} by the full sort, computed once for every implementation."""
    if (kind, t) not in _reference_cache:
        x = _row(kind)
        p = S.probs(x, t)
        _reference_cache[(kind, t)] = {(i, d): reference_token(p, d, **kw)
                                       for i, kw in enumerate(SETTINGS) for d in _draws(kind, t)}
    return _reference_cache[(kind, t)]


@pytest.mark.parametrize("kind", KINDS)
def test_numpy_path_is_the_definition(kind):
    for t in TEMPERATURES:
        want = _reference(kind, t)
        x = _row(kind)
        got = {(i, d): S.sample_numpy(x, t, draw=d, **kw) for i, kw in enumerate(SETTINGS) for d in _draws(kind, t)}
        assert got == want


@pytest.mark.parametrize("kind", KINDS)
def test_native_choices_are_the_definition(kind, isa):
    """Every implementation (the row passes are compiled per instruction set) chooses the token the
    definition gives, for every setting and draw, the extreme draws included."""
    w = native_sample.work(129280)
    for t in TEMPERATURES:
        want = _reference(kind, t)
        x = _row(kind)
        got = {(i, d): native_sample.sample(x, t, draw=d, work_buf=w, **kw)
               for i, kw in enumerate(SETTINGS) for d in _draws(kind, t)}
        assert got == want


def test_native_equals_numpy_many_seeds():
    """Random rows, settings and temperatures from a seed: the native and the numpy path agree."""
    rng = np.random.default_rng(21)
    for _ in range(150):
        n = int(rng.choice([1, 2, 7, 1000, 4097, 129280]))
        x = (rng.standard_normal(n) * rng.choice([0.0, 1e-3, 0.1, 2.0, 10.0, 100.0])).astype(np.float32)
        if n > 2 and rng.random() < 0.3:
            x[rng.integers(0, n, n // 3 + 1)] = -np.inf
            x[rng.integers(0, n)] = 1.0
        kw = dict(top_k=int(rng.choice([0, 1, 3, 40, 10 ** 6])), top_p=float(rng.choice([1.0, 0.95, 0.3, 1e-9])),
                  min_p=float(rng.choice([0.0, 0.01, 0.5, 0.999])))
        t = float(rng.choice([1e-30, 0.1, 0.7, 1.0, 2.0, 50.0]))
        d = int(rng.integers(0, 1 << 53))
        assert native_sample.sample(x, t, draw=d, **kw) == S.sample_numpy(x, t, draw=d, **kw), (n, kw, t, d)


def test_probs_are_bit_identical(isa):
    """The defined exp, natively at every level and in numpy: the same float32 bits, over every y from
    0 down past the cutoff in fine steps, and rows at several temperatures."""
    y = np.concatenate([-np.linspace(0, 90, 400001, dtype=np.float32), np.float32([-0.0, -1e-45, -1e-38, -87, -87.00001,
                        -86.99999, -np.inf, -3e38]), -np.float32(np.ldexp(1.0, -np.arange(1, 149)))]).astype(np.float32)
    x = np.concatenate([[np.float32(0)], y]).astype(np.float32)           # max 0, temperature 1: p = exp(x)
    got = native_sample.probs(x, 1.0)
    assert (got.view(np.uint32) == S.probs(x, 1.0).view(np.uint32)).all()
    assert got.max() == 1 and got[0] == 1 and (got >= 0).all()
    ref = np.exp(x.astype(np.float64))
    close = x >= -87
    assert np.all(np.abs(got[close] - ref[close]) <= 2.5 * np.spacing(ref[close].astype(np.float32)))
    assert (got[x < -87] == 0).all()
    rng = np.random.default_rng(3)
    for t in (1e-30, 0.1, 0.7, 2.0, 1e30):
        r = (rng.standard_normal(10007) * 5).astype(np.float32)
        assert (native_sample.probs(r, t).view(np.uint32) == S.probs(r, t).view(np.uint32)).all()


def test_tokens_without_mass_are_never_drawn():
    x = np.zeros(1000, np.float32)
    x[7] = -30.0                               # p = e^-30 < 2^-S (S = 43 for 1000 ids): no mass
    p = S.probs(x, 1.0)
    assert p[7] > 0 and S.masses(p)[7] == 0
    top = (1 << 53) - 1
    for d in (0, top, top // 2):
        assert native_sample.sample(x, 1.0, draw=d) != 7
    order_last = native_sample.sample(x, 1.0, draw=top)
    assert order_last == 999                   # the last of the equal ones, in id order


def test_extreme_settings():
    x = np.float32([0.5, 2.0, 2.0, -1.0, np.inf * -1])
    assert native_sample.sample(x, 0.7, top_k=1, draw=(1 << 53) - 1) == 1      # the first of the tied top
    assert native_sample.sample(x, 1e-300, draw=(1 << 53) - 1) == 2          # tiny temperature: the tied top
    assert native_sample.sample(x, 0.0) == 1                                # greedy: the first maximum
    assert native_sample.sample(x, 0.7, min_p=0.999, draw=(1 << 53) - 1) == 2
    with pytest.raises(CpumlaError):
        native_sample.sample(x, 0.7, draw=1 << 53)
    with pytest.raises(CpumlaError):
        native_sample.sample(x, 0.7, top_p=0.0)


def test_sampler_is_the_numpy_path_on_its_seed():
    """Sampler.choose draws u = rng.random() once a token, as the definition says."""
    rng = np.random.default_rng(2)
    x = (rng.standard_normal(129280) * 2).astype(np.float32)
    kw = dict(top_k=50, top_p=0.9, min_p=0.01)
    s = S.Sampler(temperature=0.8, seed=99, **kw)
    mirror = np.random.default_rng(99)
    for _ in range(20):
        assert s.choose(x) == S.sample_numpy(x, 0.8, draw=S.draw_of(mirror.random()), **kw)
    y = x[:1000].copy()                                      # another row size: the work buffer follows
    assert s.choose(y) == S.sample_numpy(y, 0.8, draw=S.draw_of(mirror.random()), **kw)


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
    y = np.zeros(129280, np.float32)
    for bad, word, kw in ((np.inf, "infinite", {}), (np.nan, "NaN", {"repeat_penalty": 1.3})):
        y[100000] = bad
        for t in (0.0, 0.7):
            with pytest.raises(CpumlaError, match=word):
                S.Sampler(temperature=t, **kw).choose(y)
            with pytest.raises(CpumlaError, match=word):
                S.sample_numpy(y, t)
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
