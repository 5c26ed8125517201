"""The served model: one engine, its tokenizer and chat format, and generation as a blocking job that
runs on the server's one worker thread and reports through a callback (app.py turns the reports into
responses).

Prefix reuse works as in `cpumla chat` (cpumla/chat/conversation.py): the server remembers the
tokenization of the last prompt and of the answer it generated, as (text, ids) pieces cut at added
tokens. A new prompt that starts with those pieces reuses their ids (the model's own answer tokens, not
a re-encoding that could split differently), and only the tokens past the longest common prefix with
the cache are prefilled (`Engine.truncate`). A chat client that sends back the conversation with the
answer it got therefore prefills only the new turn. Requests are stateless: this is a cache, never
history the server adds to a prompt.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from cpumla.chat.chat_format import END_THINK, THINK, ChatFormat, Message, detect_family
from cpumla.chat.reuse import Pieces, answer_pieces, ids_of, prompt_pieces, sync_cache
from cpumla.chat.tokenizer import IncrementalDecoder, Tokenizer
from cpumla.errors import CpumlaError
from cpumla.models import PREFILL_CHUNK
from cpumla.sampling import Sampler
from cpumla.server.protocol import Sampling, bad


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
    finish: str = ""               # "stop" | "length" | "cancelled" | "error"
    prompt_s: float = 0.0
    gen_s: float = 0.0


@dataclass
class Job:
    prompt: Prompt
    sampling: Sampling
    max_tokens: int
    split_reasoning: bool = False  # chat: <think>...</think> goes to reasoning, the rest to content
    strip_first_space: bool = False
    cancelled: threading.Event = field(default_factory=threading.Event)
    stats: Stats = field(default_factory=Stats)

    def cancel(self) -> None:
        self.cancelled.set()


class StopStrings:
    """Cuts text at the first stop string; holds back a tail that could be the start of one."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.held = ""

    def push(self, text: str) -> tuple[str, bool]:
        """(text safe to send, whether a stop string was hit)."""
        buf = self.held + text
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.held = ""
            return buf[:min(hits)], True
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


class ServedModel:
    def __init__(self, name: str, engine, tokenizer: Tokenizer, fmt: ChatFormat, stop_ids):
        self.name, self.engine, self.tok, self.fmt = name, engine, tokenizer, fmt
        stops = {tokenizer.token_id(s) for s in fmt.stop_strings} | set(stop_ids or ())
        self.stop_ids = frozenset(i for i in stops if i is not None)
        self.think_ids = {tokenizer.token_id(THINK), tokenizer.token_id(END_THINK)} - {None}
        self._known: Pieces = []

    @property
    def ctx(self) -> int:
        return self.engine.max_seq_len

    # ---- prompts (called with the engine held) ----
    def chat_prompt(self, messages: list[tuple[str, str, str]], think: bool | None) -> Prompt:
        if self.fmt.always_thinks:
            think = True                 # R1's format has no switch
        elif not self.fmt.think_switch:
            think = False
        text = self.fmt.render([Message(r, c, reasoning) for r, c, reasoning in messages], think=bool(think))
        return self._text_prompt(text, thinks=text.rstrip().endswith(THINK))

    def completion_prompt(self, prompt: str | list[int]) -> Prompt:
        if isinstance(prompt, list):
            return Prompt(list(prompt), [])
        bos = self.tok.bos_token
        if bos and not prompt.startswith(bos):
            prompt = bos + prompt        # as the tokenizer's add_special_tokens would
        return self._text_prompt(prompt)

    def check(self, prompt: Prompt, max_tokens: int | None, param: str = "messages") -> int:
        """The number of tokens to generate; ApiError when the prompt cannot run (param: the request
        field that holds the prompt)."""
        n, ctx = len(prompt.ids), self.ctx
        vocab = self.engine.config.vocab_size
        bad_id = next((i for i in prompt.ids if i >= vocab), None)
        if bad_id is not None:
            raise bad(f"token id {bad_id} is outside the model's vocabulary ({vocab})", param)
        if n >= ctx:
            raise bad(f"the prompt is {n} tokens; the context holds {ctx}", param,
                      "context_length_exceeded")
        if max_tokens is None:
            return ctx - n
        if n + max_tokens > ctx:
            raise bad(f"the prompt ({n} tokens) plus max_tokens ({max_tokens}) is more than the context "
                      f"({ctx} tokens); ask for at most {ctx - n}", "max_tokens", "context_length_exceeded")
        return max_tokens

    def _text_prompt(self, text: str, thinks: bool = False) -> Prompt:
        pieces = prompt_pieces(self.tok, self._known, text)
        return Prompt(ids_of(pieces), pieces, thinks)

    # ---- generation (the worker thread) ----
    def run(self, job: Job, emit: Callable[[str, str], None]) -> None:
        """Prefill and generate, calling emit("reasoning" | "content", text) as text arrives, and
        emit("error", message) on a failure. Stops between tokens once job.cancel() is called."""
        eng, st, ids = self.engine, job.stats, job.prompt.ids
        st.prompt_tokens, gen, t0 = len(ids), [], time.perf_counter()
        try:
            st.cached_tokens = cached = self._sync_cache(ids)
            logits = None
            for c0 in range(cached, len(ids), PREFILL_CHUNK):
                if job.cancelled.is_set():
                    st.finish = "cancelled"
                    return
                logits = eng.forward(ids[c0:c0 + PREFILL_CHUNK], last_only=True)
            st.prompt_s = time.perf_counter() - t0
            self._decode(job, logits, gen, emit)
        except CpumlaError as e:
            st.finish = "error"
            emit("error", str(e))
        finally:
            st.completion_tokens = len(gen)
            st.gen_s = time.perf_counter() - t0 - st.prompt_s
            self._remember(job.prompt.pieces if job.prompt.pieces else [], gen)

    def _decode(self, job: Job, logits, gen: list[int], emit) -> None:
        eng, st = self.engine, job.stats
        sp = job.sampling
        sampler = Sampler(temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k, min_p=sp.min_p, seed=sp.seed)
        dec, stops = IncrementalDecoder(self.tok), StopStrings(sp.stop)
        state = {"reasoning": job.split_reasoning and job.prompt.thinks, "first": job.strip_first_space}

        def out(text: str) -> bool:
            """Send text on the current channel; True when a stop string ends the answer."""
            if not text:
                return False
            if state["reasoning"]:
                emit("reasoning", text)
                return False
            if state["first"]:
                state["first"] = False
                text = text[1:] if text.startswith(" ") else text
            text, hit = stops.push(text)
            if text:
                emit("content", text)
            return hit

        while True:
            if job.cancelled.is_set():
                st.finish = "cancelled"
                return
            tok = sampler(logits[-1])
            if tok in self.stop_ids:
                st.finish = "stop"
                break
            gen.append(tok)
            if job.split_reasoning and tok in self.think_ids:
                if out(dec.flush()):
                    st.finish = "stop"
                    return
                state["reasoning"] = tok == self.tok.token_id(THINK)
            elif out(dec.push(tok)):
                st.finish = "stop"
                return
            if len(gen) >= job.max_tokens or eng.pos >= eng.max_seq_len:
                st.finish = "length"
                break
            if job.cancelled.is_set():
                st.finish = "cancelled"
                return
            logits = eng.forward([tok], last_only=True)
        if out(dec.flush()):
            st.finish = "stop"
            return
        tail = stops.flush()
        if tail:
            emit("content", tail)

    def _sync_cache(self, ids: list[int]) -> int:
        return sync_cache(self.engine, ids)

    def _remember(self, pieces: Pieces, gen: list[int]) -> None:
        """The last prompt's pieces and the answer's tokens, as text pieces."""
        self._known = list(pieces) + answer_pieces(self.tok, gen)


def load_served(model: str, *, dummy_weights: bool = False, hf_overrides=None, dummy_dtype: str = "bf16",
                seed: int = 0, threads: int | None = None, ctx: int | None = None,
                tokenizer: str | None = None, quant: str | None = None,
                progress=None, memory: int | None = None) -> tuple[ServedModel, list[str]]:
    """(ServedModel, notices): the engine, tokenizer and chat format as `cpumla chat` sets them up
    (a dummy model's vocabulary grows to fit the tokenizer). Raises CpumlaError."""
    from cpumla.chat.tokenizer import load_tokenizer
    from cpumla.runtime.loader import load
    from cpumla.runtime.resolve import load_config

    overrides = dict(hf_overrides or {})
    cfg, resolved = load_config(model, overrides)
    tok, notices = load_tokenizer(resolved, tokenizer, dummy_weights)
    if tok.vocab_size > cfg.vocab_size and "vocab_size" not in overrides:
        if dummy_weights:
            notices.append(f"vocab_size raised from {cfg.vocab_size} to {tok.vocab_size} to fit the tokenizer "
                           f"({tok.source})")
            overrides["vocab_size"] = tok.vocab_size
        elif not tok.bundled:
            notices.append(f"the tokenizer has {tok.vocab_size} ids, the model {cfg.vocab_size}")
    engine = load(model, dummy_weights=dummy_weights, hf_overrides=overrides, seed=seed, threads=threads,
                         max_seq_len=ctx, dummy_dtype=dummy_dtype, quant=quant, progress=progress,
                         resolved=resolved, memory=memory)
    name = resolved.repo_id or (resolved.directory.name if resolved.directory else model)
    own_template = None if tok.bundled else tok.chat_template
    fmt = ChatFormat(detect_family(cfg.model_type, name, own_template), chat_template=own_template,
                     bos=tok.bos_token or "", eos=tok.eos_token or "")
    return ServedModel(model, engine, tok, fmt, [] if tok.bundled else cfg.eos_ids), notices
