"""Chat formats of the DeepSeek families: a conversation -> the prompt string the model was trained on.

Special tokens are written as their strings and looked up by string by the tokenizer, never as ids.
  V2 / V2.5      {bos}{system}\\n\\nUser: {u}\\n\\nAssistant: {a}{eos}User: {u2}\\n\\nAssistant:
  V3 / R1        {bos}{system}<｜User｜>{u}<｜Assistant｜>{a}{eos}<｜User｜>{u2}<｜Assistant｜>   (R1: + "<think>\\n")
  V3.1           ...<｜User｜>{u}<｜Assistant｜></think>{a}{eos}<｜User｜>{u2}<｜Assistant｜>{<think> | </think>}
  V3.2 / V4      the same shape as V3.1 (encoding_dsv32.py / encoding_dsv4.py, chat and thinking modes;
                 reasoning of turns before the last user message is dropped, those turns get </think>)
  Moonlight      <|im_system|>system<|im_middle|>{system}<|im_end|><|im_user|>user<|im_middle|>{u}<|im_end|>
                 <|im_assistant|>assistant<|im_middle|>{a}<|im_end|>...<|im_assistant|>assistant<|im_middle|>
                 (no system message: "You are a helpful assistant", as its chat_template writes)
A model directory whose tokenizer_config.json has a `chat_template` is rendered through it (a bounded jinja
sandbox with transformers' settings, cpumla/chat/template.py); the built-in formats are its equivalent for the bundled tokenizer and presets.
Assistant history keeps only the answer: every format drops the reasoning of earlier turns.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from cpumla.chat.tools import Tool, ToolCall, ToolFormat
from cpumla.errors import CpumlaError

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK = "<think>"
END_THINK = "</think>"

FAMILIES = ("deepseek-v2", "deepseek-v3", "deepseek-r1", "deepseek-v3.1", "deepseek-v3.2", "deepseek-v4", "moonlight")
IM_END = "<|im_end|>"
MOONLIGHT_SYSTEM = "You are a helpful assistant"


@dataclass
class Message:
    role: str            # "system" | "user" | "assistant" | "tool"
    content: str
    reasoning: str = ""  # assistant only: the text between <think> and </think>
    tool_calls: list[ToolCall] = field(default_factory=list)   # assistant only


def _grouped(messages: list[Message], tf: ToolFormat | None) -> list[Message]:
    """Runs of tool messages as one message of their rendered results ("tool" when the family continues
    the assistant turn with them, "user" when they make a user turn)."""
    out: list[Message] = []
    for m in messages:
        if m.role != "tool":
            out.append(m)
            continue
        tf = tf or ToolFormat("deepseek-v3")
        if out and out[-1].role == "tool-run":
            out[-1].tool_calls.append(m.content)
        else:
            out.append(Message("tool-run", "", tool_calls=[m.content]))
    for i, m in enumerate(out):
        if m.role == "tool-run":
            out[i] = Message("user" if tf.results_in_user_turn else "tool", tf.render_results(m.tool_calls))
    return out


def detect_family(model_type: str, name: str = "", chat_template: str | None = None) -> str:
    """The chat family from config.json's model_type and the model's name (repo id or directory)."""
    n = name.lower()
    if "moonlight" in n or (chat_template and "<|im_middle|>" in chat_template):
        return "moonlight"
    if model_type == "deepseek_v2":
        return "deepseek-v2"
    if model_type == "deepseek_v32":
        return "deepseek-v3.2"
    if model_type == "deepseek_v4":
        return "deepseek-v4"
    if re.search(r"v3\.1|terminus", n) or (chat_template and "thinking" in chat_template):
        return "deepseek-v3.1"
    if re.search(r"(^|[^a-z0-9])r1([^0-9]|$)", n):
        return "deepseek-r1"
    return "deepseek-v3"


def format_for(model_type: str, name: str, tok) -> "ChatFormat":
    """The chat format of a model (config.json's model_type, its repo id or directory name) with tokenizer
    `tok`: its own chat_template when it has one (the bundled tokenizers' are not the model's), else the
    family's built-in format; Moonlight's tiktoken tokenizer means Moonlight's format."""
    from cpumla.chat.tiktoken_tokenizer import TiktokenTokenizer

    own = None if tok.bundled else tok.chat_template
    family = "moonlight" if isinstance(tok, TiktokenTokenizer) else detect_family(model_type, name, own)
    return ChatFormat(family, chat_template=own, bos=tok.bos_token or "", eos=tok.eos_token or "")


def _system(messages: list[Message]) -> str:
    return "\n\n".join(m.content for m in messages if m.role == "system")


def _answer(m: Message, tf: ToolFormat | None = None) -> str:
    """An assistant turn as history keeps it: the answer after any </think>, then its tool calls."""
    text = m.content.split(END_THINK)[-1]
    return text + tf.render_calls(m.tool_calls) if tf is not None and m.tool_calls else text


def with_tools(messages: list[Message], tools: list[Tool] | None, tf: ToolFormat) -> list[Message]:
    """The conversation with the tool list added to (or as) its system message, and tool results
    grouped the family's way."""
    msgs = _grouped(messages, tf)
    if not tools:
        return msgs
    block = tf.system_block(tools)
    sys_at = next((i for i, m in enumerate(msgs) if m.role == "system"), None)
    if sys_at is None:
        return [Message("system", block)] + msgs
    msgs = list(msgs)
    msgs[sys_at] = Message("system", msgs[sys_at].content + "\n\n" + block)
    return msgs


def render_v2(messages: list[Message], add_generation_prompt: bool = True, bos: str = BOS, eos: str = EOS,
              tf: ToolFormat | None = None) -> str:
    out = [bos]
    for m in messages:
        if m.role == "system":
            out.append(m.content + "\n\n")
        elif m.role == "user":
            out.append("User: " + m.content + "\n\n")
        elif m.role == "assistant":
            out.append("Assistant: " + _answer(m, tf) + eos)
    if add_generation_prompt:
        out.append("Assistant:")
    return "".join(out)


def render_v3(messages: list[Message], add_generation_prompt: bool = True, bos: str = BOS, eos: str = EOS,
              generation_prompt: str = ASSISTANT, tf: ToolFormat | None = None) -> str:
    """V3 and R1 (R1 later shipped generation_prompt "<｜Assistant｜><think>\\n"). Tool results continue
    the assistant turn: the answer after them follows without a new <｜Assistant｜>."""
    out = [bos, _system(messages)]
    after_tool = False
    for m in messages:
        if m.role == "user":
            out.append(USER + m.content)
        elif m.role == "assistant":
            out.append(("" if after_tool else ASSISTANT) + _answer(m, tf) + eos)
        elif m.role == "tool":
            out.append(m.content)
        after_tool = m.role == "tool"
    if add_generation_prompt and not after_tool:
        out.append(generation_prompt)
    return "".join(out)


def render_v31(messages: list[Message], think: bool, add_generation_prompt: bool = True, bos: str = BOS,
               eos: str = EOS, tf: ToolFormat | None = None) -> str:
    out = [bos, _system(messages)]
    last_user = False
    for m in messages:
        if m.role == "user":
            out.append(USER + m.content)
        elif m.role == "assistant":
            out.append((ASSISTANT + END_THINK if last_user else "") + _answer(m, tf) + eos)
        elif m.role == "tool":
            out.append(m.content)
        last_user = m.role == "user"
    if add_generation_prompt and last_user:
        out.append(ASSISTANT + (THINK if think else END_THINK))
    return "".join(out)


def render_v4(messages: list[Message], think: bool, add_generation_prompt: bool = True, bos: str = BOS,
              eos: str = EOS, tf: ToolFormat | None = None) -> str:
    """The chat/thinking subset of encoding_dsv4.py (and encoding_dsv32.py): thinking_mode "thinking"
    when think, else "chat"; drop_thinking on. V3.2's tool results ("tool" messages) continue the
    assistant turn, then a fresh think marker; V4's arrive as a user turn."""
    last_user = max((i for i, m in enumerate(messages) if m.role == "user"), default=-1)
    out = [bos]
    for i, m in enumerate(messages):
        nxt = messages[i + 1].role if i + 1 < len(messages) else None
        opens = nxt == "assistant" or (nxt is None and add_generation_prompt)
        if m.role == "system":
            out.append(m.content)
        elif m.role in ("user", "tool"):
            out.append(m.content if m.role == "tool" else USER + m.content)
            if opens:
                marker = THINK if think and i >= last_user else END_THINK
                out.append("\n\n" + marker if m.role == "tool" else ASSISTANT + marker)
        elif m.role == "assistant":
            kept = think and i > last_user          # only the turn being completed keeps its reasoning
            out.append((m.reasoning + END_THINK if kept else "") + _answer(m, tf) + eos)
    return "".join(out)


def render_moonlight(messages: list[Message], add_generation_prompt: bool = True,
                     tf: ToolFormat | None = None) -> str:
    """Moonlight-16B-A3B-Instruct's chat_template: every message as <|im_{role}|>{role}<|im_middle|>
    {content}<|im_end|>, a default system message when the first is not one."""
    tags = {"system": "<|im_system|>", "user": "<|im_user|>", "assistant": "<|im_assistant|>"}
    out = []
    if messages and messages[0].role != "system":
        out.append(f"<|im_system|>system<|im_middle|>{MOONLIGHT_SYSTEM}{IM_END}")
    for m in messages:
        content = _answer(m, tf) if m.role == "assistant" else m.content
        out.append(f"{tags[m.role]}{m.role}<|im_middle|>{content}{IM_END}")
    if add_generation_prompt:
        out.append("<|im_assistant|>assistant<|im_middle|>")
    return "".join(out)


class ChatFormat:
    """One family's format: render(messages, think) -> prompt string, stop strings, the think switch."""

    def __init__(self, family: str, chat_template: str | None = None, bos: str = BOS, eos: str = EOS):
        if family not in FAMILIES:
            raise CpumlaError(f"unknown chat format '{family}' (known: {', '.join(FAMILIES)})")
        self.family = family
        self.bos, self.eos = bos or "", eos or EOS
        self.chat_template = chat_template
        self._jinja = None
        self.stop_strings = (IM_END, self.eos) if family == "moonlight" else (self.eos,)
        self.tools = ToolFormat(family)

    @property
    def source(self) -> str:
        return "chat_template" if self.chat_template else "built-in"

    @property
    def think_switch(self) -> bool:
        """Whether thinking can be turned on and off (V3.1, V3.2, V4)."""
        return self.family in ("deepseek-v3.1", "deepseek-v3.2", "deepseek-v4")

    @property
    def always_thinks(self) -> bool:
        return self.family == "deepseek-r1"

    def render(self, messages: list[Message], think: bool = False, add_generation_prompt: bool = True,
               tools: list[Tool] | None = None) -> str:
        """The prompt; tools, when given, are described in the system message in the family's format."""
        if self.chat_template:
            return self._render_jinja(messages, think, add_generation_prompt, tools)
        messages = with_tools(messages, tools, self.tools)
        f, kw = self.family, dict(add_generation_prompt=add_generation_prompt, bos=self.bos, eos=self.eos, tf=self.tools)
        if f == "moonlight":
            return render_moonlight(messages, add_generation_prompt, tf=self.tools)
        if f == "deepseek-v2":
            return render_v2(messages, **kw)
        if f == "deepseek-v3":
            return render_v3(messages, **kw)
        if f == "deepseek-r1":
            return render_v3(messages, generation_prompt=ASSISTANT + THINK + "\n", **kw)
        if f == "deepseek-v3.1":
            return render_v31(messages, think, **kw)
        return render_v4(messages, think, **kw)

    def _render_jinja(self, messages, think, add_generation_prompt, tools) -> str:
        from cpumla.chat.template import compile_template

        msgs = []
        for m in messages:
            d = {"role": m.role, "content": _answer(m) if m.role == "assistant" else m.content}
            if m.tool_calls:
                d["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                                   for c in m.tool_calls]
            msgs.append(d)
        kw = {"tools": [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                          "parameters": t.parameters}} for t in tools]} if tools else {}
        if self._jinja is None:
            self._jinja = compile_template(self.chat_template)
        return self._jinja(messages=msgs, add_generation_prompt=add_generation_prompt, bos_token=self.bos,
                           eos_token=self.eos, thinking=think, enable_thinking=think, **kw)
