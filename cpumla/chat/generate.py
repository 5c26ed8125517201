"""Text generation over one engine, shared by `cpumla serve` and the Python text API (Engine.chat /
Engine.complete): a prompt from messages or text, then a blocking loop that samples, decodes text
incrementally and reports it through a callback, split into reasoning and content, cut at stop strings,
with tool calls parsed out of the content, an optional grammar constraint, and log-probabilities.

Prefix reuse works as in `cpumla chat` (cpumla/chat/conversation.py): the generator remembers the
tokenization of the last prompt and of the answer it generated, as (text, ids) pieces cut at added
tokens. A new prompt that starts with those pieces reuses their ids (the model's own answer tokens, not
a re-encoding that could split differently), and only the tokens past the longest common prefix with
the cache are prefilled (`Engine.truncate`). A client that sends back the conversation with the answer
it got therefore prefills only the new turn. This is a cache, never history added to a prompt.

A constraint (a grammar the answer must follow) applies to the answer, not to a thinking model's
reasoning; so that a constrained answer always has room, the reasoning is closed (</think> written for
the model) once it has used half of max_tokens.

Reports: emit(kind, payload) with kind "reasoning" | "content" (text), "tool_calls" (list of ToolCall),
"logprobs" (one entry per generated content token), "error" (a message).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from cpumla.chat.chat_format import END_THINK, THINK, ChatFormat, Message, format_for
from cpumla.chat.reuse import Pieces, answer_pieces, ids_of, prompt_pieces, sync_cache
from cpumla.chat.tokenizer import IncrementalDecoder, Tokenizer
from cpumla.chat.tools import Tool, ToolFormat
from cpumla.errors import CpumlaError
from cpumla.models import PREFILL_CHUNK
from cpumla.sampling import Sampler


@dataclass
class Sampling:
    max_tokens: int | None          # None: the rest of the context
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)


@dataclass
class Prompt:
    ids: list[int]
    pieces: Pieces                 # its tokenization as text pieces (empty for a prompt given as ids)
    thinks: bool = False           # the prompt ends inside <think>: the answer starts as reasoning


@dataclass
class Stats:
    prompt_tokens: int = 0
    cached_tokens: int = 0         # prompt tokens already in the cache (not prefilled)
    completion_tokens: int = 0
    reasoning_tokens: int = 0      # of completion_tokens, those generated inside <think>...</think>
    finish: str = ""               # "stop" | "length" | "tool_calls" | "cancelled" | "error"
    stop_string: str | None = None  # the stop string that ended the answer
    prompt_s: float = 0.0
    gen_s: float = 0.0


@dataclass
class Job:
    prompt: Prompt
    sampling: Sampling
    max_tokens: int
    split_reasoning: bool = False  # chat: <think>...</think> goes to reasoning, the rest to content
    strip_first_space: bool = False
    tools: ToolFormat | None = None    # parse calls out of the content in this format
    parallel_tool_calls: bool = True
    constraint: Callable | None = None  # () -> chat.constraint.Constraint, applied to the content
    logprobs: int | None = None    # None: none; k: the chosen token's and the k most likely
    cancelled: threading.Event = field(default_factory=threading.Event)
    stats: Stats = field(default_factory=Stats)

    def cancel(self) -> None:
        self.cancelled.set()


@dataclass
class Answer:
    """A whole answer gathered from a job's reports (the module's doc): text as it came, in pieces."""
    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    tool_calls: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)

    def add(self, kind: str, payload) -> None:
        """One report other than "error" (and the server's "done")."""
        if kind in ("tool_calls", "logprobs"):
            getattr(self, kind).extend(payload)
        else:
            getattr(self, kind).append(payload)

    @property
    def text(self) -> str:
        return "".join(self.content)

    @property
    def reasoning_text(self) -> str:
        return "".join(self.reasoning)


class StopStrings:
    """Cuts text at the first stop string; holds back a tail that could be the start of one."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.held = ""
        self.hit: str | None = None      # the stop string that ended the text
        self.rest = ""                   # the text after it

    def push(self, text: str) -> tuple[str, bool]:
        """(text safe to send, whether a stop string was hit)."""
        buf = self.held + text
        hits = [(i, s) for s in self.stops for i in (buf.find(s),) if i >= 0]
        if hits:
            at, self.hit = min(hits)
            self.held, self.rest = "", buf[at + len(self.hit):]
            return buf[:at], True
        keep = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), keep, -1):
                if s.startswith(buf[-k:]):
                    keep = k
                    break
        self.held = buf[len(buf) - keep:]
        return buf[:len(buf) - keep], False

    def flush(self) -> str:
        out, self.held = self.held, ""
        return out


class ToolWatch:
    """The content channel when tools are on: text before the opener of a block of calls goes out, the
    block is held to the end and parsed; one that does not parse goes out as content."""

    def __init__(self, fmt: ToolFormat, parallel: bool):
        self.fmt, self.parallel = fmt, parallel
        self.opener = StopStrings([fmt.opener])     # holds back what could be the opener's start
        self.block: list[str] | None = None

    def push(self, text: str) -> str:
        if self.block is not None:
            self.block.append(text)
            return ""
        out, hit = self.opener.push(text)
        if hit:
            self.block = [self.fmt.opener + self.opener.rest]
        return out

    def finish(self, tail: str = ""):
        """(text to send, calls or None) at the end of the answer."""
        if self.block is None:
            return self.opener.flush() + tail, None
        block = "".join(self.block) + tail
        parsed = self.fmt.parse(block)
        if parsed is None:
            return block, None
        head, calls = parsed
        return head, calls if self.parallel else calls[:1]


def token_logprobs(logits: np.ndarray, chosen: int, k: int) -> tuple[float, list[tuple[int, float]]]:
    """log p(chosen) and the k most likely (id, log p), most likely first, under softmax(logits)."""
    x = logits.astype(np.float64)
    finite = np.isfinite(x)
    m = x[finite].max()
    lse = m + np.log(np.exp(x[finite] - m).sum())
    top: list[tuple[int, float]] = []
    if k:
        idx = np.argpartition(-x, k - 1)[:k]
        idx = idx[np.lexsort((idx, -x[idx]))]          # most likely first, ties by id
        top = [(int(i), float(x[i] - lse)) for i in idx]
    return float(x[chosen] - lse), top


class Generator:
    """One engine with its tokenizer and chat format; prompts are made and jobs run with the engine held
    (one at a time)."""

    def __init__(self, engine, tokenizer: Tokenizer, fmt: ChatFormat, stop_ids=()):
        self.engine, self.tok, self.fmt = engine, tokenizer, fmt
        stops = {tokenizer.token_id(s) for s in fmt.stop_strings} | set(stop_ids or ())
        self.stop_ids = frozenset(i for i in stops if i is not None)
        self.think_ids = {tokenizer.token_id(THINK), tokenizer.token_id(END_THINK)} - {None}
        self._known: Pieces = []

    @classmethod
    def of(cls, engine, tok: Tokenizer, name: str, *more):
        """A generator on `engine` with tokenizer `tok`: the model's chat format (format_for; name: its
        repo id or directory) and the config's eos ids as stops, unless the tokenizer is a bundled
        stand-in. more: the subclass's own arguments."""
        fmt = format_for(engine.config.model_type, name, tok)
        return cls(engine, tok, fmt, [] if tok.bundled else engine.config.eos_ids, *more)

    @property
    def ctx(self) -> int:
        return self.engine.max_seq_len

    def chat_job(self) -> dict:
        """The Job fields of every chat answer: reasoning apart where the format thinks, and V2's space
        after "Assistant:" left out of the answer."""
        return dict(split_reasoning=self.fmt.think_switch or self.fmt.always_thinks,
                    strip_first_space=self.fmt.family == "deepseek-v2")

    # ---- prompts ----
    def think_for(self, think: bool | None) -> bool:
        if self.fmt.always_thinks:
            return True                  # R1's format has no switch
        return bool(think) if self.fmt.think_switch else False

    def chat_prompt(self, messages: list[Message], think: bool | None, tools: list[Tool] | None = None) -> Prompt:
        text = self.fmt.render(messages, think=self.think_for(think), tools=tools)
        return self._text_prompt(text, thinks=text.rstrip().endswith(THINK))

    def completion_prompt(self, prompt: str | list[int]) -> Prompt:
        if isinstance(prompt, list):
            return Prompt(list(prompt), [])
        bos = self.tok.bos_token
        if bos and not prompt.startswith(bos):
            prompt = bos + prompt        # as the tokenizer's add_special_tokens would
        return self._text_prompt(prompt)

    def check(self, prompt: Prompt, max_tokens: int | None) -> int:
        """The number of tokens to generate; CpumlaError (with .param) when the prompt cannot run."""
        n, ctx = len(prompt.ids), self.ctx
        vocab = self.engine.config.vocab_size
        bad_id = next((i for i in prompt.ids if i >= vocab), None)
        if bad_id is not None:
            raise PromptError(f"token id {bad_id} is outside the model's vocabulary ({vocab})")
        if n >= ctx:
            raise PromptError(f"the prompt is {n} tokens; the context holds {ctx}", code="context_length_exceeded")
        if max_tokens is None:
            return ctx - n
        if n + max_tokens > ctx:
            raise PromptError(f"the prompt ({n} tokens) plus max_tokens ({max_tokens}) is more than the context "
                              f"({ctx} tokens); ask for at most {ctx - n}", "max_tokens", "context_length_exceeded")
        return max_tokens

    def _text_prompt(self, text: str, thinks: bool = False) -> Prompt:
        pieces = prompt_pieces(self.tok, self._known, text)
        return Prompt(ids_of(pieces), pieces, thinks)

    # ---- generation (blocking) ----
    def run(self, job: Job, emit: Callable[[str, object], None]) -> None:
        """Prefill and generate, reporting through emit (see the module's doc). Stops between tokens once
        job.cancel() is called."""
        eng, st, ids = self.engine, job.stats, job.prompt.ids
        st.prompt_tokens, gen, t0 = len(ids), [], time.perf_counter()
        try:
            st.cached_tokens = cached = sync_cache(eng, ids)
            logits = None
            for c0 in range(cached, len(ids), PREFILL_CHUNK):
                if job.cancelled.is_set():
                    st.finish = "cancelled"
                    return
                logits = eng.forward(ids[c0:c0 + PREFILL_CHUNK], last_only=True)
            st.prompt_s = time.perf_counter() - t0
            _Decode(self, job, emit, gen).run(logits)
        except CpumlaError as e:
            st.finish = "error"
            emit("error", str(e))
        finally:
            st.completion_tokens = len(gen)
            st.gen_s = time.perf_counter() - t0 - st.prompt_s
            self._known = list(job.prompt.pieces) + answer_pieces(self.tok, gen)


class PromptError(CpumlaError):
    """A prompt that cannot run; param names the request field at fault (None: the prompt's)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


class _Decode:
    """One job's decode loop and its channels."""

    def __init__(self, gen: Generator, job: Job, emit, out_ids: list[int]):
        self.g, self.job, self.emit, self.ids = gen, job, emit, out_ids
        sp = job.sampling
        self.sampler = Sampler(temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k, min_p=sp.min_p, seed=sp.seed)
        self.dec, self.stops = IncrementalDecoder(gen.tok), StopStrings(sp.stop)
        self.reasoning = job.split_reasoning and job.prompt.thinks
        self.first = job.strip_first_space
        self.tools = ToolWatch(job.tools, job.parallel_tool_calls) if job.tools is not None else None
        self.constraint = None
        self.calls = None

    def out(self, text: str) -> bool:
        """Send text on the current channel; True when a stop string ends the answer."""
        if not text:
            return False
        if self.reasoning:
            self.emit("reasoning", text)
            return False
        if self.first:
            self.first = False
            text = text[1:] if text.startswith(" ") else text
        text, hit = self.stops.push(text)
        if self.tools is not None:
            text = self.tools.push(text)
        if text:
            self.emit("content", text)
        return hit

    def _constrained(self, logits: np.ndarray) -> np.ndarray:
        if self.reasoning or self.job.constraint is None:
            return logits
        if self.constraint is None:
            self.constraint = self.job.constraint()
        return self.constraint.apply(logits)

    def run(self, logits) -> None:
        with self.g.engine.stepper() as self.step:     # drafts verified ahead are dropped at the end
            self._run(logits)

    def _run(self, logits) -> None:
        job, st, eng, g = self.job, self.job.stats, self.g.engine, self.g
        end_think = g.tok.token_id(END_THINK)
        while True:
            if job.cancelled.is_set():
                st.finish = "cancelled"
                return
            if self.reasoning and job.constraint is not None and end_think is not None \
                    and len(self.ids) >= job.max_tokens // 2:
                tok = end_think     # a constrained answer keeps half of max_tokens: the reasoning ends here
            else:
                tok = self.sampler(self._constrained(logits[-1]))
            if tok in g.stop_ids:
                st.finish = "stop"
                break
            self.ids.append(tok)
            if self.reasoning:
                st.reasoning_tokens += 1
            elif self.constraint is not None:
                self.constraint.advance(tok)
            if job.logprobs is not None and not self.reasoning and tok not in g.think_ids:
                lp, top = token_logprobs(logits[-1], tok, job.logprobs)
                self.emit("logprobs", [(tok, lp, top)])
            if job.split_reasoning and tok in g.think_ids:
                if self.out(self.dec.flush()):
                    st.finish = "stop"
                    return self._end()
                self.reasoning = tok != end_think
            elif self.out(self.dec.push(tok)):
                st.finish = "stop"
                return self._end()
            if self.constraint is not None and self.constraint.done:
                st.finish = "stop"
                break
            if len(self.ids) >= job.max_tokens or self.step.at >= eng.max_seq_len:
                st.finish = "length"
                break
            if job.cancelled.is_set():
                st.finish = "cancelled"
                return
            logits = self.step(tok)[None]
        if self.out(self.dec.flush()):
            st.finish = "stop"
        self._end()

    def _end(self) -> None:
        self.job.stats.stop_string = self.stops.hit
        tail = self.stops.flush()
        if self.tools is not None:
            tail, calls = self.tools.finish(tail)
            if calls:
                self.job.stats.finish = "tool_calls"
        else:
            calls = None
        if tail:
            self.emit("content", tail)
        if calls:
            self.emit("tool_calls", calls)
