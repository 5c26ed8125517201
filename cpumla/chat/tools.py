"""Tool calling in each family's own format: the tool list in the system prompt, earlier calls and their
results in the history, the calls a model writes parsed back out of its text, and a grammar (llguidance's
Lark dialect) that makes a model write one when a call is required.

  V3 / R1     <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\nARGS\\n```<｜tool▁call▁end｜>
              (several joined by \\n) <｜tool▁calls▁end｜>; results <｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>
              TEXT<｜tool▁output▁end｜>...<｜tool▁outputs▁end｜>, and the answer goes on without a new turn
  V3.1        <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>;
              results <｜tool▁output▁begin｜>TEXT<｜tool▁output▁end｜> each, the answer goes on
  V3.2 / V4   DSML: <｜DSML｜function_calls> (V4: tool_calls) holding <｜DSML｜invoke name="NAME"> with one
              <｜DSML｜parameter name="K" string="true|false">V</｜DSML｜parameter> per argument (strings as
              they are, anything else as JSON); V3.2's results <function_results><result>TEXT</result>...
              </function_results> continue the assistant turn, V4's <tool_result>TEXT</tool_result> make a
              user turn
  V2, Moonlight  no trained tool format: <tool_call>{"name": NAME, "arguments": ARGS}</tool_call>, results
              as a user turn of <tool_result>TEXT</tool_result>
Special tokens are written as strings; the grammar refers to them by id (`<[id]>`), looked up by string.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"
OUTPUTS_BEGIN = "<｜tool▁outputs▁begin｜>"
OUTPUTS_END = "<｜tool▁outputs▁end｜>"
OUTPUT_BEGIN = "<｜tool▁output▁begin｜>"
OUTPUT_END = "<｜tool▁output▁end｜>"
DSML = "｜DSML｜"

# JSON arguments as json.dumps writes them: the separators the history is rendered with, no free whitespace
# (a weak model could otherwise fill max_tokens with spaces inside a constrained call)
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass
class Tool:
    name: str
    description: str
    parameters: dict          # a JSON schema of the arguments object


@dataclass
class ToolCall:
    name: str
    arguments: str            # a JSON object, as text
    id: str = ""

    def __post_init__(self):
        if not self.id:
            self.id = "call_" + uuid.uuid4().hex[:24]


def _fn_json(t: Tool, indent=None) -> str:
    return json.dumps({"name": t.name, "description": t.description, "parameters": t.parameters},
                      ensure_ascii=False, indent=indent)


def _args_obj(call: ToolCall) -> dict:
    try:
        v = json.loads(call.arguments or "{}")
    except json.JSONDecodeError:
        return {}
    return v if isinstance(v, dict) else {}


def _dsml_value(v) -> tuple[str, str]:
    return ("true", v) if isinstance(v, str) else ("false", json.dumps(v, ensure_ascii=False))


class ToolFormat:
    """One family's tool syntax. `opener` starts a block of calls in the model's output."""

    def __init__(self, family: str):
        self.family = family
        self.style = {"deepseek-v3": "v3", "deepseek-r1": "v3", "deepseek-v3.1": "v31", "deepseek-v3.2": "v32",
                      "deepseek-v4": "v4"}.get(family, "plain")
        self.block = {"v32": "function_calls", "v4": "tool_calls"}.get(self.style, "")
        self.opener = {"v3": CALLS_BEGIN, "v31": CALLS_BEGIN, "plain": "<tool_call>"}.get(
            self.style, f"<{DSML}{self.block}>")

    @property
    def results_in_user_turn(self) -> bool:
        """Tool results start a user turn (V4, plain) rather than continue the assistant's."""
        return self.style in ("v4", "plain")

    # ---- the prompt ----
    def system_block(self, tools: list[Tool]) -> str:
        if self.style == "v3":
            return ("You can call the functions below to answer the user's request.\n"
                    + json.dumps([json.loads(_fn_json(t)) for t in tools], ensure_ascii=False, indent=2)
                    + "\n\nA call is written as:\n" + CALLS_BEGIN + CALL_BEGIN + "function" + SEP
                    + "FUNCTION_NAME\n```json\n{\"argument\": \"value\"}\n```" + CALL_END + CALLS_END + "\n")
        if self.style == "v31":
            parts = ["## Tools\nThese tools are available:\n"]
            for t in tools:
                parts.append(f"### {t.name}\nDescription: {t.description}\n\nParameters: "
                             f"{json.dumps(t.parameters, ensure_ascii=False)}\n")
            parts.append("Call a tool in exactly this form: " + CALLS_BEGIN + CALL_BEGIN + "tool_name" + SEP
                         + "arguments as a JSON object" + CALL_END + CALLS_END
                         + " (more calls go before the closing marker, each in its own call markers). "
                           "Use only the tools listed, with valid JSON arguments.\n")
            return "\n".join(parts)
        if self.style in ("v32", "v4"):
            d, b = DSML, self.block
            return ("## Tools\n\nThese tools can help with the user's request. Call them with a block like:\n\n"
                    f"<{d}{b}>\n<{d}invoke name=\"TOOL_NAME\">\n<{d}parameter name=\"PARAMETER\" "
                    f"string=\"true|false\">VALUE</{d}parameter>\n...\n</{d}invoke>\n</{d}{b}>\n\n"
                    "A string parameter is written as it is with string=\"true\"; numbers, booleans, arrays "
                    "and objects as JSON with string=\"false\".\n\n### Tool schemas\n\n"
                    + "".join(_fn_json(t) + "\n" for t in tools)
                    + "\nUse only these tools and parameters.\n")
        return ("You can call these tools:\n" + "".join(_fn_json(t) + "\n" for t in tools)
                + '\nTo call one, answer with <tool_call>{"name": "TOOL_NAME", "arguments": {...}}</tool_call>.\n')

    def render_calls(self, calls: list[ToolCall]) -> str:
        """An assistant turn's calls, as the model writes them (after its text)."""
        if not calls:
            return ""
        if self.style == "v3":
            return CALLS_BEGIN + "\n".join(
                f"{CALL_BEGIN}function{SEP}{c.name}\n```json\n{c.arguments}\n```{CALL_END}" for c in calls) + CALLS_END
        if self.style == "v31":
            return CALLS_BEGIN + "".join(f"{CALL_BEGIN}{c.name}{SEP}{c.arguments}{CALL_END}" for c in calls) + CALLS_END
        if self.style in ("v32", "v4"):
            d, out = DSML, [f"\n\n<{DSML}{self.block}>\n"]
            for c in calls:
                out.append(f'<{d}invoke name="{c.name}">\n')
                for k, v in _args_obj(c).items():
                    s, text = _dsml_value(v)
                    out.append(f'<{d}parameter name="{k}" string="{s}">{text}</{d}parameter>\n')
                out.append(f"</{d}invoke>\n")
            return "".join(out) + f"</{d}{self.block}>"
        return "".join(f'<tool_call>{{"name": {json.dumps(c.name)}, "arguments": {c.arguments or "{}"}}}</tool_call>'
                       for c in calls)

    def render_results(self, results: list[str]) -> str:
        """Consecutive tool messages' contents, as the format writes them."""
        if self.style == "v3":
            return OUTPUTS_BEGIN + "\n".join(f"{OUTPUT_BEGIN}{r}{OUTPUT_END}" for r in results) + OUTPUTS_END
        if self.style == "v31":
            return "".join(f"{OUTPUT_BEGIN}{r}{OUTPUT_END}" for r in results)
        if self.style == "v32":
            return "\n\n<function_results>" + "".join(f"\n<result>{r}</result>" for r in results) + "\n</function_results>"
        return "\n\n".join(f"<tool_result>{r}</tool_result>" for r in results)

    # ---- the model's output ----
    def parse(self, text: str) -> tuple[str, list[ToolCall]] | None:
        """(content before the calls, calls) from an answer that holds a block of calls; None when the
        text holds none or they do not parse (the caller then keeps the text as content)."""
        at = text.find(self.opener)
        if at < 0:
            return None
        head, block = text[:at], text[at:]
        calls = {"v3": self._parse_v3, "v31": self._parse_v31, "plain": self._parse_plain}.get(
            self.style, self._parse_dsml)(block)
        if not calls:
            return None
        if self.style in ("v32", "v4"):
            head = head.rstrip("\n")
        return head, calls

    @staticmethod
    def _json_args(raw: str) -> str | None:
        try:
            v = json.loads(raw)
        except json.JSONDecodeError:
            return None
        return json.dumps(v, ensure_ascii=False) if isinstance(v, dict) else None

    def _parse_v3(self, block: str) -> list[ToolCall] | None:
        pat = re.compile(re.escape(CALL_BEGIN) + r"\w*" + re.escape(SEP) + r"(.*?)\n```(?:json)?\n(.*?)\n```"
                         + re.escape(CALL_END), re.S)
        return self._calls(pat.findall(block), block)

    def _parse_v31(self, block: str) -> list[ToolCall] | None:
        pat = re.compile(re.escape(CALL_BEGIN) + r"(.*?)" + re.escape(SEP) + r"(.*?)" + re.escape(CALL_END), re.S)
        return self._calls(pat.findall(block), block)

    def _parse_plain(self, block: str) -> list[ToolCall] | None:
        found = []
        for raw in re.findall(r"<tool_call>(.*?)</tool_call>", block, re.S):
            try:
                v = json.loads(raw)
            except json.JSONDecodeError:
                return None
            if not (isinstance(v, dict) and isinstance(v.get("name"), str) and isinstance(v.get("arguments", {}), dict)):
                return None
            found.append((v["name"], json.dumps(v.get("arguments", {}), ensure_ascii=False)))
        return self._calls(found, block)

    def _calls(self, found, block: str) -> list[ToolCall] | None:
        calls = []
        for name, raw in found:
            args = self._json_args(raw)
            if args is None or not name.strip():
                return None
            calls.append(ToolCall(name.strip(), args))
        return calls or None

    def _parse_dsml(self, block: str) -> list[ToolCall] | None:
        d = re.escape(DSML)
        calls = []
        for name, body in re.findall(rf'<{d}invoke name="([^"]*)">(.*?)</{d}invoke>', block, re.S):
            args = {}
            for key, is_str, value in re.findall(
                    rf'<{d}parameter name="([^"]*)" string="(true|false)">(.*?)</{d}parameter>', body, re.S):
                if is_str == "true":
                    args[key] = value
                else:
                    try:
                        args[key] = json.loads(value)
                    except json.JSONDecodeError:
                        return None
            if not name:
                return None
            calls.append(ToolCall(name, json.dumps(args, ensure_ascii=False)))
        return calls or None

    # ---- constrained calls ----
    def grammar(self, tools: list[Tool], token_id, parallel: bool) -> str:
        """A Lark grammar (llguidance) of a block of calls to `tools` (one or, when parallel, several);
        token_id(str) gives a special token's id."""
        def tok(s: str) -> str:
            i = token_id(s)
            return f"<[{i}]>" if i is not None else json.dumps(s, ensure_ascii=False)

        rules, alts = [], []
        for k, t in enumerate(tools):
            args = f"args{k}"
            rules.append(f"{args}: %json {json.dumps(_with_style(t.parameters), ensure_ascii=False)}")
            name = json.dumps(t.name, ensure_ascii=False)
            if self.style == "v3":
                alts.append(f'{tok(CALL_BEGIN)} "function" {tok(SEP)} {name} "\\n```json\\n" {args} "\\n```" {tok(CALL_END)}')
            elif self.style == "v31":
                alts.append(f"{tok(CALL_BEGIN)} {name} {tok(SEP)} {args} {tok(CALL_END)}")
            elif self.style == "plain":
                alts.append(f'"<tool_call>{{\\"name\\": " {json.dumps(json.dumps(t.name))} ", \\"arguments\\": " {args} "}}</tool_call>"')
            else:
                alts.append(self._dsml_rule(k, t, rules))
        one = "call: " + " | ".join(alts)
        many = "call+" if parallel else "call"
        if self.style in ("v3", "v31"):
            sep = ' ("\\n" call)*' if parallel and self.style == "v3" else (" call*" if parallel else "")
            start = f"start: {tok(CALLS_BEGIN)} call{sep} {tok(CALLS_END)}"
        elif self.style == "plain":
            start = f"start: {many}"
        else:
            start = f'start: "<{DSML}{self.block}>\\n" {many} "</{DSML}{self.block}>"'
        return "\n".join([start, one, *rules]) + "\n"

    def _dsml_rule(self, k: int, t: Tool, rules: list[str]) -> str:
        """One invoke of tool k: its properties in schema order, the required ones always present."""
        d = DSML
        props = t.parameters.get("properties") or {}
        required = set(t.parameters.get("required") or ())
        parts = [json.dumps(f'<{d}invoke name="{t.name}">\n', ensure_ascii=False)]
        for j, (key, schema) in enumerate(props.items()):
            rule = f"p{k}_{j}"
            raw = _raw_string(schema)
            head = json.dumps(f'<{d}parameter name="{key}" string="{"true" if raw else "false"}">', ensure_ascii=False)
            tail = json.dumps(f"</{d}parameter>\n", ensure_ascii=False)
            if raw is not None:
                value = raw
            else:
                value = f"v{k}_{j}"
                rules.append(f"{value}: %json {json.dumps(_with_style(schema), ensure_ascii=False)}")
            rules.append(f"{rule}: {head} {value} {tail}")
            parts.append(rule if key in required else f"{rule}?")
        parts.append(json.dumps(f"</{d}invoke>\n"))
        return " ".join(parts)


def _raw_string(schema) -> str | None:
    """The Lark expression of a string parameter written as it is (DSML string="true"): free text without
    '<', its length bounds, or its enum's values; None for anything else (written as JSON)."""
    if not isinstance(schema, dict) or schema.get("type") != "string" or {"pattern", "format", "const"} & set(schema):
        return None
    if "enum" in schema:
        values = schema["enum"]
        if not values or not all(isinstance(v, str) and "<" not in v for v in values):
            return None
        return "(" + " | ".join(json.dumps(v, ensure_ascii=False) for v in values) + ")"
    lo, hi = schema.get("minLength", 0), schema.get("maxLength")
    if not isinstance(lo, int) or (hi is not None and not isinstance(hi, int)):
        return None
    return "/[^<]*/" if (lo, hi) == (0, None) else f"/[^<]{{{lo},{'' if hi is None else hi}}}/"


def closed(schema):
    """The schema with additionalProperties false wherever an object lists properties and says nothing
    about others: what a constrained answer may write is what the schema names (as xgrammar's strict mode
    and OpenAI's strict schemas do; an explicit additionalProperties is kept)."""
    if isinstance(schema, list):
        return [closed(v) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for k, v in schema.items():
        if k in ("properties", "patternProperties", "$defs", "definitions") and isinstance(v, dict):
            out[k] = {name: closed(sub) for name, sub in v.items()}      # maps of names to schemas
        else:
            out[k] = v if k in ("enum", "const", "default", "examples") else closed(v)
    if isinstance(schema.get("properties"), dict) and "additionalProperties" not in schema:
        out["additionalProperties"] = False
    return out


def _with_style(schema) -> dict:
    out = closed(schema if isinstance(schema, dict) else {})
    out["x-guidance"] = {**JSON_STYLE, **(out.get("x-guidance") or {})}
    return out


def tool_from_openai(obj: dict) -> Tool:
    fn = obj["function"]
    return Tool(fn["name"], fn.get("description") or "", fn.get("parameters") or {"type": "object", "properties": {}})
