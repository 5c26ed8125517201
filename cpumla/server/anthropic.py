"""Anthropic's Messages API (`POST /v1/messages`) over the same generation: the request's content blocks
(text, tool_use, tool_result, thinking) become the conversation, `tools` / `tool_choice` / `thinking` map
onto what /v1/chat/completions does, and the answer comes back as content blocks (thinking, text,
tool_use), whole or as Anthropic's typed server-sent events. Errors take Anthropic's shape
({"type": "error", "error": {"type", "message"}})."""

from __future__ import annotations

import json
import math
import uuid
from dataclasses import dataclass, field

from cpumla.chat.chat_format import Message
from cpumla.chat.generate import Sampling
from cpumla.chat.tools import Tool, ToolCall
from cpumla.server import protocol as P
from cpumla.server.structured import Structured

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 503: "overloaded_error"}
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def error_body(e: P.ApiError) -> dict:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(e.status, "api_error"), "message": e.message}}


@dataclass
class MessagesRequest:
    messages: list[Message]
    sampling: Sampling
    stream: bool = False
    think: bool | None = None
    structured: Structured = field(default_factory=Structured)


def _text(v, where: str) -> str:
    """A string, or a list of text blocks."""
    if isinstance(v, str):
        return v
    if isinstance(v, list):
        out = []
        for j, b in enumerate(v):
            if not (isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str)):
                raise P.bad(f"{where}[{j}] must be a text block", f"{where}[{j}]")
            out.append(b["text"])
        return "".join(out)
    raise P.bad(f"{where} must be a string or a list of text blocks", where)


def _turn(i: int, m) -> list[Message]:
    where = f"messages[{i}]"
    if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
        raise P.bad(f'{where} must be {{"role": "user" | "assistant", "content": ...}}', f"{where}.role")
    role, content = m["role"], m.get("content")
    if isinstance(content, str):
        return [Message(role, content)]
    if not isinstance(content, list):
        raise P.bad(f"{where}.content must be a string or a list of content blocks", f"{where}.content")
    text, reasoning, calls, results = [], [], [], []
    for j, b in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text" and isinstance(b.get("text"), str):
            text.append(b["text"])
        elif kind == "thinking" and role == "assistant" and isinstance(b.get("thinking"), str):
            reasoning.append(b["thinking"])
        elif kind == "redacted_thinking" and role == "assistant":
            pass
        elif kind == "tool_use" and role == "assistant" and isinstance(b.get("name"), str) and isinstance(b.get("input", {}), dict):
            calls.append(ToolCall(b["name"], json.dumps(b.get("input", {}), ensure_ascii=False), str(b.get("id") or "")))
        elif kind == "tool_result" and role == "user":
            body = _text(b.get("content", ""), f"{at}.content")
            results.append(Message("tool", ("Error: " + body) if b.get("is_error") else body))
        else:
            raise P.bad(f"{at}: a {json.dumps(kind)} block is not supported in a {role} message (text, thinking, "
                        f"tool_use and tool_result are)", at)
    if role == "assistant":
        return [Message("assistant", "".join(text), "".join(reasoning), calls)]
    return results + ([Message("user", "".join(text))] if text or not results else [])


def parse(body: dict) -> MessagesRequest:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise P.bad("messages must be a non-empty list", "messages")
    out: list[Message] = []
    system = body.get("system")
    if system is not None:
        out.append(Message("system", _text(system, "system")))
    for i, m in enumerate(msgs):
        out.extend(_turn(i, m))
    if out[-1].role not in ("user", "tool"):
        raise P.bad("the last message must be from the user", f"messages[{len(msgs) - 1}].role")
    max_tokens = P.integer(body, "max_tokens", 1)
    if max_tokens is None:
        raise P.bad("max_tokens is required", "max_tokens")
    stops = body.get("stop_sequences") or []
    if not (isinstance(stops, list) and all(isinstance(s, str) for s in stops)):
        raise P.bad("stop_sequences must be a list of strings", "stop_sequences")
    sampling = Sampling(max_tokens=max_tokens, temperature=P.number(body, "temperature", 1.0, 0.0, math.inf),
                        top_p=P.number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
                        top_k=P.integer(body, "top_k", 0) or 0, stop=[s for s in stops if s])
    return MessagesRequest(out, sampling, P.boolean(body, "stream"), _thinking(body.get("thinking")), _structured(body))


def _thinking(v) -> bool | None:
    if v is None:
        return None
    kind = v.get("type") if isinstance(v, dict) else None
    if kind not in ("enabled", "disabled", "adaptive"):
        raise P.bad('thinking must be {"type": "enabled", "budget_tokens": N} or {"type": "disabled"}', "thinking")
    return kind != "disabled"


def _structured(body: dict) -> Structured:
    st = Structured()
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise P.bad("tools must be a list", "tools")
        for i, t in enumerate(tools):
            if not isinstance(t, dict) or not isinstance(t.get("name"), str) or not t["name"]:
                raise P.bad(f"tools[{i}] must have a name (and an input_schema)", f"tools[{i}]")
            schema = t.get("input_schema") or {"type": "object", "properties": {}}
            if not isinstance(schema, dict) or not isinstance(t.get("description", ""), str):
                raise P.bad(f"tools[{i}].input_schema must be a JSON schema object", f"tools[{i}].input_schema")
            st.tools.append(Tool(t["name"], t.get("description") or "", schema))
    choice = body.get("tool_choice")
    if choice is not None:
        kind = choice.get("type") if isinstance(choice, dict) else None
        if kind not in ("auto", "any", "tool", "none"):
            raise P.bad('tool_choice.type must be "auto", "any", "tool" or "none"', "tool_choice")
        if kind in ("any", "tool") and not st.tools:
            raise P.bad(f'tool_choice "{kind}" needs tools', "tool_choice")
        if kind == "tool" and not any(t.name == choice.get("name") for t in st.tools):
            raise P.bad(f"tool_choice names the tool {json.dumps(choice.get('name'))}, which is not in tools", "tool_choice")
        st.choice = {"auto": "auto", "any": "required", "tool": "function", "none": "none"}[kind]
        st.function = choice.get("name") if kind == "tool" else None
        st.parallel = not choice.get("disable_parallel_tool_use", False)
    return st


# ---- responses ----
def new_id() -> str:
    return "msg_" + uuid.uuid4().hex[:24]


def usage(st) -> dict:
    return {"input_tokens": st.prompt_tokens - st.cached_tokens, "output_tokens": st.completion_tokens,
            "cache_read_input_tokens": st.cached_tokens, "cache_creation_input_tokens": 0}


def _stop(st) -> tuple[str, str | None]:
    if st.finish == "stop" and st.stop_string is not None:
        return "stop_sequence", st.stop_string
    return STOP_REASONS.get(st.finish, "end_turn"), None


def _tool_use(c: ToolCall) -> dict:
    return {"type": "tool_use", "id": c.id, "name": c.name, "input": json.loads(c.arguments or "{}")}


def message(mid: str, model: str, answer, job) -> dict:
    """The whole message of a job (answer: chat.generate.Answer)."""
    st = job.stats
    blocks = []
    if answer.reasoning:
        blocks.append({"type": "thinking", "thinking": answer.reasoning_text, "signature": ""})
    if answer.text or not answer.tool_calls:
        blocks.append({"type": "text", "text": answer.text})
    blocks += [_tool_use(c) for c in answer.tool_calls]
    reason, seq = _stop(st)
    return {"id": mid, "type": "message", "role": "assistant", "model": model, "content": blocks,
            "stop_reason": reason, "stop_sequence": seq, "usage": usage(st)}


def _event(kind: str, data: dict) -> bytes:
    return f"event: {kind}\ndata: ".encode() + json.dumps({"type": kind, **data}, ensure_ascii=False).encode() + b"\n\n"


async def stream(job, events, mid: str, model: str):
    """Anthropic's events of one job: message_start, a block per channel run (thinking, text, tool_use)
    with its deltas, message_delta with the stop reason and usage, message_stop."""
    st = job.stats
    yield _event("message_start", {"message": {
        "id": mid, "type": "message", "role": "assistant", "model": model, "content": [], "stop_reason": None,
        "stop_sequence": None, "usage": {**usage(st), "input_tokens": st.prompt_tokens, "output_tokens": 0}}})
    index, open_kind = -1, None

    def close():
        return _event("content_block_stop", {"index": index})

    while True:
        ev, payload = await events.get()
        if ev == "done":
            break
        if ev == "error":
            yield _event("error", {"error": {"type": "api_error", "message": payload}})
            return
        if ev in ("reasoning", "content"):
            kind = "thinking" if ev == "reasoning" else "text"
            if open_kind != kind:
                if open_kind is not None:
                    yield close()
                index, open_kind = index + 1, kind
                yield _event("content_block_start", {"index": index, "content_block": {"type": kind, kind: ""}})
            delta = {"type": "thinking_delta", "thinking": payload} if kind == "thinking" else {"type": "text_delta", "text": payload}
            yield _event("content_block_delta", {"index": index, "delta": delta})
        elif ev == "tool_calls":
            for c in payload:
                if open_kind is not None:
                    yield close()
                index, open_kind = index + 1, "tool_use"
                yield _event("content_block_start", {"index": index, "content_block": {
                    "type": "tool_use", "id": c.id, "name": c.name, "input": {}}})
                yield _event("content_block_delta", {"index": index, "delta": {
                    "type": "input_json_delta", "partial_json": c.arguments}})
    if st.finish == "cancelled":
        return
    if open_kind is not None:
        yield close()
    reason, seq = _stop(st)
    yield _event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": seq},
                                   "usage": {"output_tokens": st.completion_tokens}})
    yield _event("message_stop", {})
