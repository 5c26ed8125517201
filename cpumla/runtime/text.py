"""The engine's text-level API: `Engine.chat(messages)` and `Engine.complete(text)` on the model's own
tokenizer and chat format (loaded on first use), returning a `Reply`, or with stream=True yielding
`Delta`s as the text arrives (reasoning apart from the answer), as mlx-lm's and llama-cpp-python's users
expect. Generation is chat/generate.py's, the same loop `cpumla serve` runs, so the cache of the last
prompt and answer is reused across calls."""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field

from cpumla.chat.chat_format import Message
from cpumla.chat.generate import Answer, Generator, Job, Sampling
from cpumla.chat.tools import Tool, ToolCall
from cpumla.errors import CpumlaError

SAMPLING = ("temperature", "top_p", "top_k", "min_p", "seed")


@dataclass
class Delta:
    """A piece of a streamed answer: text of the answer, or of the reasoning, or the tool calls."""
    text: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass
class Reply:
    text: str
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    finish: str = ""                 # "stop" | "length" | "tool_calls"
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0


class Text:
    """What the text API needs besides the engine: the model's tokenizer and chat format, found as
    `cpumla chat` finds them (loaded on first use)."""

    def __init__(self, model: str, resolved, dummy_weights: bool, tokenizer: str | None = None):
        self.model, self.resolved, self.dummy, self.tokenizer = model, resolved, dummy_weights, tokenizer
        self._gen: Generator | None = None

    def generator(self, engine) -> Generator:
        if self._gen is None:
            from cpumla.chat.tokenizer import load_tokenizer

            tok, _ = load_tokenizer(self.resolved, self.tokenizer, self.dummy)
            self._gen = Generator.of(engine, tok, self.resolved.name or self.model)
        return self._gen


def messages_of(messages) -> list[Message]:
    """Message objects, or OpenAI-style dicts {"role", "content"[, "reasoning_content", "tool_calls"]}."""
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    out = []
    for i, m in enumerate(messages):
        if isinstance(m, Message):
            out.append(m)
            continue
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "tool") \
                or not isinstance(m.get("content") or "", str):
            raise CpumlaError(f"messages[{i}] must be a Message or {{'role': system|user|assistant|tool, "
                              f"'content': str}}")
        calls = [c if isinstance(c, ToolCall) else ToolCall(c["function"]["name"], c["function"]["arguments"])
                 for c in m.get("tool_calls") or ()]
        out.append(Message(m["role"], m.get("content") or "", m.get("reasoning_content") or "", calls))
    if not out:
        raise CpumlaError("messages is empty")
    return out


def _sampling(max_tokens, stop, kw) -> Sampling:
    unknown = set(kw) - set(SAMPLING)
    if unknown:
        raise CpumlaError(f"unknown sampling argument {sorted(unknown)[0]!r} (known: {', '.join(SAMPLING)})")
    if isinstance(stop, str):
        stop = [stop]
    return Sampling(max_tokens=max_tokens, stop=[s for s in stop or () if s], **kw)


def run(gen: Generator, prompt, sampling: Sampling, stream: bool, **job_kw):
    """A Reply, or (stream) an iterator of Deltas; the prompt is made with the engine's lock free."""
    max_tokens = gen.check(prompt, sampling.max_tokens)
    job = Job(prompt, sampling, max_tokens, **job_kw)
    if not stream:
        answer, errors = Answer(), []
        gen.run(job, lambda kind, payload: errors.append(payload) if kind == "error" else answer.add(kind, payload))
        if errors:
            raise CpumlaError(errors[0])
        st = job.stats
        return Reply(answer.text, answer.reasoning_text, answer.tool_calls, st.finish, st.prompt_tokens,
                     st.cached_tokens, st.completion_tokens)
    return _stream(gen, job)


def _stream(gen: Generator, job: Job):
    q: queue.Queue = queue.Queue()
    worker = threading.Thread(target=lambda: (gen.run(job, lambda k, p: q.put((k, p))), q.put(("done", None))),
                              name="cpumla-text", daemon=True)
    worker.start()
    try:
        while True:
            kind, payload = q.get()
            if kind == "done":
                return
            if kind == "error":
                raise CpumlaError(payload)
            if kind == "content":
                yield Delta(text=payload)
            elif kind == "reasoning":
                yield Delta(reasoning=payload)
            elif kind == "tool_calls":
                yield Delta(tool_calls=list(payload))
    finally:                 # the caller stopped early (or the loop ended): the worker stops at its next token
        job.cancel()
        worker.join()


def chat(engine, messages, stream: bool, think, tools, max_tokens, stop, kw):
    gen = engine.text_generator()
    msgs = messages_of(messages)
    tool_list = [t if isinstance(t, Tool) else Tool(t["function"]["name"], t["function"].get("description", ""),
                                                    t["function"].get("parameters") or {"type": "object"})
                 for t in tools or ()]
    fmt = gen.fmt
    return run(gen, gen.chat_prompt(msgs, think, tool_list or None), _sampling(max_tokens, stop, kw), stream,
               tools=fmt.tools if tool_list else None, **gen.chat_job())


def complete(engine, text: str, stream: bool, max_tokens, stop, kw):
    if not isinstance(text, str) or not text:
        raise CpumlaError("complete() takes a non-empty string")
    gen = engine.text_generator()
    return run(gen, gen.completion_prompt(text), _sampling(max_tokens, stop, kw), stream)
