"""Engine's API edges: generate's arguments are checked when it is called (one CpumlaError, nothing run),
and a generation whose cache someone else changes (reset, truncate, another forward) stops with an error
instead of producing tokens from a cache that is no longer its own."""

from __future__ import annotations

import pytest

import cpumla
from cpumla import CpumlaError


@pytest.fixture(scope="module")
def engine():
    e = cpumla.load("deepseek-ai/DeepSeek-V2-Lite", dummy_weights=True, hf_overrides={"num_hidden_layers": 1},
                    max_seq_len=64)
    yield e
    e.close()


@pytest.mark.parametrize("bad", ["abc", -1, 2.5, None, True])
def test_generate_checks_max_new_tokens_when_called(engine, bad):
    engine.reset()
    with pytest.raises(CpumlaError, match="max_new_tokens"):
        engine.generate([1, 2, 3], max_new_tokens=bad)
    assert engine.pos == 0                      # nothing ran


def test_generate_checks_sampling_when_called(engine):
    engine.reset()
    with pytest.raises(CpumlaError, match="temperature"):
        engine.generate([1, 2, 3], 4, temperature="hot")
    assert engine.pos == 0


@pytest.mark.parametrize("change", ["reset", "truncate", "forward"])
def test_a_generation_whose_cache_changed_stops(engine, change):
    engine.reset()
    gen = engine.generate([1, 2, 3], 10, temperature=0)
    next(gen)
    {"reset": engine.reset, "truncate": lambda: engine.truncate(2), "forward": lambda: engine.forward([5])}[change]()
    pos = engine.pos
    with pytest.raises(CpumlaError, match="changed"):
        next(gen)
    assert engine.pos == pos                    # it did not run on the changed cache


def test_an_undisturbed_generation_runs_to_its_limit(engine):
    engine.reset()
    toks = list(engine.generate([1, 2, 3], 6, temperature=0, stop_ids=[]))
    assert len(toks) == 6 and engine.pos == 3 + 6           # every token generated is in the cache
    again = (engine.reset(), list(engine.generate([1, 2, 3], 6, temperature=0, stop_ids=[])))[1]
    assert again == toks
