"""The request fields that shape an answer: `tools`, `tool_choice`, `parallel_tool_calls` and
`response_format` (OpenAI's), checked into a `Structured`, whose grammar is compiled (and refused with a
400 naming what llguidance cannot do) before the request waits for the engine.

tool_choice "auto" lets the model call tools or answer (its calls are parsed out of the text); "none"
leaves the tools out of the prompt; "required" and a named function constrain decoding to a block of
calls in the family's format whose arguments match each function's schema. response_format
json_object / json_schema constrain the answer to JSON (matching the schema). Both apply to the answer,
not to the reasoning of a thinking model."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from cpumla.chat.constraint import Constraint, check_grammar, lark_grammar, schema_grammar
from cpumla.chat.tools import JSON_STYLE, Tool, ToolCall, closed
from cpumla.errors import CpumlaError

MAX_TOOLS = 128


class FieldError(ValueError):
    """A bad field: message and the field's name (protocol.py turns it into a 400)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass
class Structured:
    tools: list[Tool] = field(default_factory=list)
    choice: str = "auto"                 # "auto" | "none" | "required" | "function"
    function: str | None = None          # the named function of choice "function"
    parallel: bool = True
    schema: dict | None = None           # response_format's schema ({"type": "object"} for json_object)

    @property
    def prompt_tools(self) -> list[Tool] | None:
        return self.tools if self.tools and self.choice != "none" else None

    def constraint_grammar(self, tool_format, token_id) -> str | None:
        """The grammar the answer must follow, or None."""
        if self.choice in ("required", "function") and self.tools:
            chosen = [t for t in self.tools if self.choice == "required" or t.name == self.function]
            return lark_grammar(tool_format.grammar(chosen, token_id, self.parallel and self.choice == "required"))
        if self.schema is not None:
            return schema_grammar(closed(self.schema), JSON_STYLE)
        return None

    def job_kw(self, served) -> dict:
        """Job fields for this request on a served model (ServedModel / Generator); the grammar compiled
        once here, a FieldError naming what it cannot take."""
        kw: dict = {}
        if self.prompt_tools:
            kw["tools"] = served.fmt.tools
            kw["parallel_tool_calls"] = self.parallel
        tool_call = self.choice in ("required", "function") and self.tools
        try:
            grammar = self.constraint_grammar(served.fmt.tools, served.tok.token_id)
            if grammar is not None:
                check_grammar(grammar, "the schema is not supported")
        except CpumlaError as e:
            raise FieldError(str(e), "tools" if tool_call else "response_format") from None
        if grammar is not None:
            tok, n = served.tok, served.engine.config.vocab_size
            if not hasattr(tok, "to_json"):
                raise FieldError(f"constrained output is not available with this model's tokenizer ({tok.source})",
                                 "tool_choice" if tool_call else "response_format")
            kw["constraint"] = lambda: Constraint(tok, n, grammar)
        return kw


def parse_structured(body: dict, chat: bool) -> Structured:
    st = Structured()
    if chat:
        st.tools = _tools(body.get("tools"))
        st.choice, st.function = _tool_choice(body.get("tool_choice"), st.tools)
        p = body.get("parallel_tool_calls")
        if p is not None and not isinstance(p, bool):
            raise FieldError("parallel_tool_calls must be true or false", "parallel_tool_calls")
        st.parallel = p is not False
    elif body.get("tools") is not None:
        raise FieldError("tools are for /v1/chat/completions", "tools")
    st.schema = _response_format(body.get("response_format"))
    return st


def _tools(v) -> list[Tool]:
    if v is None:
        return []
    if not isinstance(v, list) or len(v) > MAX_TOOLS:
        raise FieldError(f"tools must be a list of at most {MAX_TOOLS} function tools", "tools")
    out, names = [], set()
    for i, t in enumerate(v):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
            raise FieldError(f'{where} must be {{"type": "function", "function": {{...}}}}', where)
        fn = t["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not name or len(name) > 64 or not all(c.isalnum() or c in "_-" for c in name):
            raise FieldError(f"{where}.function.name must be 1-64 letters, digits, _ or -", f"{where}.function.name")
        if name in names:
            raise FieldError(f"{where}: the function name '{name}' is used twice", f"{where}.function.name")
        names.add(name)
        desc = fn.get("description") or ""
        if not isinstance(desc, str):
            raise FieldError(f"{where}.function.description must be a string", f"{where}.function.description")
        params = fn.get("parameters")
        if params is None:
            params = {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise FieldError(f"{where}.function.parameters must be a JSON schema object", f"{where}.function.parameters")
        out.append(Tool(name, desc, params))
    return out


def _tool_choice(v, tools: list[Tool]) -> tuple[str, str | None]:
    if v is None:
        return "auto", None
    if v in ("auto", "none", "required"):
        if v == "required" and not tools:
            raise FieldError('tool_choice "required" needs tools', "tool_choice")
        return v, None
    if isinstance(v, dict) and v.get("type") == "function" and isinstance(v.get("function"), dict):
        name = v["function"].get("name")
        if not any(t.name == name for t in tools):
            raise FieldError(f"tool_choice names the function {json.dumps(name)}, which is not in tools", "tool_choice")
        return "function", name
    raise FieldError('tool_choice must be "auto", "none", "required" or {"type": "function", "function": '
                     '{"name": ...}}', "tool_choice")


def _response_format(v) -> dict | None:
    if v is None:
        return None
    kind = v.get("type") if isinstance(v, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        js = v.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("schema", {}), dict):
            raise FieldError("response_format.json_schema must be an object with a schema", "response_format")
        schema = js.get("schema") or {}
        return schema
    raise FieldError('response_format.type must be "text", "json_object" or "json_schema"', "response_format")


def parse_tool_calls(v, where: str) -> list[ToolCall]:
    """An assistant message's tool_calls (history)."""
    if v is None:
        return []
    if not isinstance(v, list):
        raise FieldError(f"{where} must be a list", where)
    out = []
    for i, c in enumerate(v):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise FieldError(f"{where}[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\", \"arguments\"}}}}",
                             f"{where}[{i}]")
        args = fn.get("arguments", "{}")
        if isinstance(args, dict):
            args = json.dumps(args, ensure_ascii=False)
        if not isinstance(args, str):
            raise FieldError(f"{where}[{i}].function.arguments must be a JSON string", f"{where}[{i}].function.arguments")
        out.append(ToolCall(fn["name"], args, str(c.get("id") or "")))
    return out
