"""The OpenAI wire format: request bodies checked into plain dataclasses, errors in OpenAI's shape, and
the response / stream-chunk objects. No I/O here: app.py reads and writes, model.py generates."""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass, field

from cpumla.chat.chat_format import Message
from cpumla.chat.generate import Sampling
from cpumla.server.structured import FieldError, Structured, parse_structured, parse_tool_calls

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
MAX_TOP_LOGPROBS = 20
MAX_STOPS = 4                  # as OpenAI
MAX_STOP_CHARS = 256
MAX_DEPTH = 32                 # nesting of a request body's arrays and objects
MAX_DIGITS = 40                # of an integer in a request body (Python's int() takes up to 4300)
MAX_INT = 2**63 - 1            # token counts, top_k


class ApiError(Exception):
    """A request the server refuses: HTTP status, OpenAI error type and code, the field at fault."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


@dataclass
class ChatRequest:
    messages: list[Message]
    sampling: Sampling
    stream: bool = False
    include_usage: bool = False
    think: bool | None = None                # None: the model's default
    structured: Structured = field(default_factory=Structured)
    logprobs: int | None = None              # None: off; k: the chosen token's and the k most likely


@dataclass
class CompletionRequest:
    prompt: str | list[int]
    sampling: Sampling
    stream: bool = False
    include_usage: bool = False
    echo: bool = False
    logprobs: int | None = None
    structured: Structured = field(default_factory=Structured)


class _TooManyDigits(ValueError):
    pass


def _parse_int(s: str) -> int:
    """json's integer hook: the digits are bounded before int() sees them."""
    if len(s.lstrip("-")) > MAX_DIGITS:
        raise _TooManyDigits(s[:12])
    return int(s)


def parse_json(raw: bytes) -> dict:
    """The request body, parsed once and bounded: UTF-8, valid JSON (NaN and Infinity are read, for the
    fields to refuse by name), integers of at
    most MAX_DIGITS digits, arrays and objects nested at most MAX_DEPTH deep, strings valid Unicode
    (no lone surrogates). Every violation is a 400."""
    try:
        body = json.loads(raw, parse_int=_parse_int)
    except UnicodeDecodeError:
        raise bad("the request body is not UTF-8") from None
    except json.JSONDecodeError as e:
        raise bad(f"the request body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except _TooManyDigits as e:
        raise bad(f"the request body has an integer of more than {MAX_DIGITS} digits ({e}...)") from None
    except RecursionError:
        raise bad(f"the request body nests arrays or objects more than {MAX_DEPTH} deep") from None
    if not isinstance(body, dict):
        raise bad(f"the request body must be a JSON object, not {kind_of(body)}")
    _check_tree(body)
    return body


def _check_tree(body) -> None:
    """Depth and strings of a parsed body, without recursion."""
    stack = [(body, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, str):
            if not v.isascii():
                try:
                    v.encode("utf-8")
                except UnicodeEncodeError:
                    raise bad("the request body holds a string that is not valid Unicode (a lone surrogate "
                              "escape such as \\ud800)") from None
            continue
        if isinstance(v, (dict, list)):
            if depth > MAX_DEPTH:
                raise bad(f"the request body nests arrays or objects more than {MAX_DEPTH} deep")
            items = [*v.keys(), *v.values()] if isinstance(v, dict) else v
            stack.extend((x, depth + 1) for x in items)


def check_model(body: dict, served: tuple[str, ...]) -> None:
    """The request's model must be one of the served names (absent: the served model)."""
    name = body.get("model")
    if name is None:
        return
    if not isinstance(name, str):
        raise bad("model must be a string", "model")
    if name not in served:
        raise ApiError(404, f"the model '{name}' does not exist; this server serves "
                            f"{', '.join(repr(n) for n in served)}", param="model", code="model_not_found")


def parse_chat(body: dict) -> ChatRequest:
    try:
        return _parse_chat(body)
    except FieldError as e:
        raise bad(str(e), e.param) from None


def parse_completion(body: dict) -> CompletionRequest:
    try:
        return _parse_completion(body)
    except FieldError as e:
        raise bad(str(e), e.param) from None


def _parse_chat(body: dict) -> ChatRequest:
    msgs = body.get("messages")
    if not isinstance(msgs, list):
        raise bad("messages must be a list of {role, content} objects", "messages")
    if not msgs:
        raise bad("messages is empty", "messages")
    out = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(f"{where} must be an object, not {kind_of(m)}", where)
        role = m.get("role")
        if not isinstance(role, str) or role not in ROLES:
            known = ", ".join(r for r in ROLES)
            raise bad(f"{where}.role {json.dumps(role)} is not supported (roles: {known})", f"{where}.role")
        calls = parse_tool_calls(m.get("tool_calls"), f"{where}.tool_calls") if role == "assistant" else []
        content = _content(m.get("content"), f"{where}.content", allow_none=role == "assistant")
        reasoning = m.get("reasoning_content") or ""
        if not isinstance(reasoning, str):
            raise bad(f"{where}.reasoning_content must be a string", f"{where}.reasoning_content")
        out.append(Message(ROLES[role], content, reasoning, calls))
    if out[-1].role not in ("user", "tool"):
        raise bad("the last message must be from the user or a tool", f"messages[{len(out) - 1}].role")
    _check_n(body)
    return ChatRequest(out, _sampling(body, ("max_completion_tokens", "max_tokens")), boolean(body, "stream"),
                       _include_usage(body), _think(body), parse_structured(body, chat=True), _chat_logprobs(body))


def _chat_logprobs(body: dict) -> int | None:
    on = boolean(body, "logprobs")
    k = integer(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if k is not None and not on:
        raise bad("top_logprobs needs logprobs: true", "top_logprobs")
    return (k or 0) if on else None


def _parse_completion(body: dict) -> CompletionRequest:
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]                            # a batch of one
    if isinstance(p, list):
        if not p or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in p):
            raise bad("prompt must be a string, or a non-empty list of token ids (one prompt per request)", "prompt")
    elif not isinstance(p, str):
        raise bad("prompt must be a string, or a list of token ids", "prompt")
    elif not p:
        raise bad("prompt is empty", "prompt")
    _check_n(body)
    logprobs = integer(body, "logprobs", 0, MAX_TOP_LOGPROBS - 15)    # OpenAI's completions allow at most 5
    if body.get("suffix"):
        raise bad("suffix is not supported", "suffix")
    if body.get("best_of") not in (None, 1):
        raise bad("best_of must be 1", "best_of")
    return CompletionRequest(p, _sampling(body, ("max_tokens",), default_max=16), boolean(body, "stream"),
                             _include_usage(body), boolean(body, "echo"), logprobs,
                             parse_structured(body, chat=False))


# ---- fields ----
def kind_of(v) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(v), "a number")


def _content(v, where: str, allow_none: bool) -> str:
    if v is None and allow_none:
        return ""
    if isinstance(v, str):
        return v
    if isinstance(v, list):           # [{"type": "text", "text": "..."}, ...]
        parts = []
        for j, part in enumerate(v):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise bad(f"{where}[{j}]: only text parts are supported", f"{where}[{j}]")
            parts.append(part["text"])
        return "".join(parts)
    raise bad(f"{where} must be a string or a list of text parts, not {kind_of(v)}", where)


def boolean(body: dict, key: str) -> bool:
    v = body.get(key, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise bad(f"{key} must be true or false", key)
    return v


def number(body: dict, key: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, int) and not isinstance(v, bool) and abs(v) > 2**53:
        v = math.inf                        # beyond every range here, and beyond exact floats
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise bad(f"{key} must be a finite number", key)
    if v < lo or (lo_open and v == lo) or v > hi:
        want = f">= {lo:g}" if hi == math.inf else f"in {'(' if lo_open else '['}{lo:g}, {hi:g}]"
        raise bad(f"{key} must be {want}, not {v:g}", key)
    return float(v)


def integer(body: dict, key: str, lo: int, hi: int = MAX_INT) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad(f"{key} must be an integer", key)
    if v < lo:
        raise bad(f"{key} must be at least {lo}, not {v}", key)
    if v > hi:
        raise bad(f"{key} must be at most {hi}, not {v}", key)
    return v


def _check_n(body: dict) -> None:
    n = body.get("n")
    if n is not None and (isinstance(n, bool) or n != 1):
        raise bad("n must be 1 (one choice per request)", "n")


def _sampling(body: dict, max_keys: tuple[str, ...], default_max: int | None = None) -> Sampling:
    max_tokens = None
    for k in max_keys:
        max_tokens = integer(body, k, 1)
        if max_tokens is not None:
            break
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise bad("stop must be a string or a list of strings", "stop")
    if len(stop) > MAX_STOPS or any(len(s) > MAX_STOP_CHARS for s in stop):
        raise bad(f"stop takes at most {MAX_STOPS} strings of at most {MAX_STOP_CHARS} characters", "stop")
    return Sampling(
        max_tokens=max_tokens if max_tokens is not None else default_max,
        temperature=number(body, "temperature", 1.0, 0.0, math.inf),
        top_p=number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        top_k=0 if body.get("top_k") == -1 else (integer(body, "top_k", 0) or 0),   # vLLM's -1: off
        min_p=number(body, "min_p", 0.0, 0.0, 0.999999),
        seed=integer(body, "seed", 0, 2**64 - 1),
        stop=[s for s in stop if s],
    )


def _include_usage(body: dict) -> bool:
    opts = body.get("stream_options")
    if opts is None:
        return False
    if not isinstance(opts, dict):
        raise bad("stream_options must be an object", "stream_options")
    return boolean(opts, "include_usage")


def _think(body: dict) -> bool | None:
    """The thinking switch, in the forms clients send: vLLM's chat_template_kwargs {"thinking": bool}
    (or {"enable_thinking": bool}), DeepSeek's API {"thinking": {"type": "enabled" | "disabled"}}, and
    OpenAI's reasoning_effort ("none" turns thinking off, any other effort on)."""
    kw = body.get("chat_template_kwargs")
    if kw is not None:
        if not isinstance(kw, dict):
            raise bad("chat_template_kwargs must be an object", "chat_template_kwargs")
        for key in ("thinking", "enable_thinking"):
            if key in kw:
                if not isinstance(kw[key], bool):
                    raise bad(f"chat_template_kwargs.{key} must be true or false", f"chat_template_kwargs.{key}")
                return kw[key]
    t = body.get("thinking")
    if t is not None:
        kind = t.get("type") if isinstance(t, dict) else None
        if kind not in ("enabled", "disabled"):
            raise bad('thinking must be {"type": "enabled"} or {"type": "disabled"}', "thinking")
        return kind == "enabled"
    effort = body.get("reasoning_effort")
    if effort is not None:
        if effort not in ("none", "minimal", "low", "medium", "high"):
            raise bad("reasoning_effort must be one of none, minimal, low, medium, high", "reasoning_effort")
        return effort != "none"
    return None


# ---- responses ----
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt: int, completion: int, cached: int, reasoning: int = 0) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
            "completion_tokens_details": {"reasoning_tokens": reasoning}}


def tool_calls_json(calls, first_index: int = 0, stream: bool = False) -> list[dict]:
    out = []
    for i, c in enumerate(calls):
        d = {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        if stream:
            d["index"] = first_index + i
        out.append(d)
    return out


def chat_logprobs(entries, text_of) -> dict:
    """OpenAI chat logprobs of (id, logprob, [(id, logprob), ...]) entries; text_of(id) -> str."""
    def one(i, lp):
        t = text_of(i)
        return {"token": t, "logprob": lp, "bytes": list(t.encode("utf-8"))}
    return {"content": [{**one(i, lp), "top_logprobs": [one(j, q) for j, q in top]} for i, lp, top in entries],
            "refusal": None}


def completion_logprobs(entries, text_of, offset: int = 0) -> dict:
    """The legacy completions shape: tokens, token_logprobs, top_logprobs ({token: logprob}), text_offset."""
    tokens, lps, tops, offs = [], [], [], []
    for i, lp, top in entries:
        t = text_of(i)
        tokens.append(t)
        lps.append(lp)
        tops.append({text_of(j): q for j, q in top})
        offs.append(offset)
        offset += len(t)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offs}


def chat_response(rid: str, model: str, content: str | None, reasoning: str | None, finish: str, use: dict,
                  tool_calls=None, logprobs: dict | None = None) -> dict:
    msg = {"role": "assistant", "content": content}
    if reasoning is not None:
        msg["reasoning_content"] = reasoning
    if tool_calls:
        msg["tool_calls"] = tool_calls_json(tool_calls)
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": msg, "logprobs": logprobs, "finish_reason": finish}], "usage": use}


def chat_chunk(rid: str, model: str, delta: dict, finish: str | None = None, use: dict | None = None,
               logprobs: dict | None = None) -> dict:
    choices = [] if use is not None else [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]
    out = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
           "choices": choices}
    if use is not None:
        out["usage"] = use
    return out


def completion_response(rid: str, model: str, text: str, finish: str, use: dict, logprobs: dict | None = None) -> dict:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}], "usage": use}


def completion_chunk(rid: str, model: str, text: str, finish: str | None = None, use: dict | None = None,
                     logprobs: dict | None = None) -> dict:
    choices = [] if use is not None else [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}]
    out = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model, "choices": choices}
    if use is not None:
        out["usage"] = use
    return out


def sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
