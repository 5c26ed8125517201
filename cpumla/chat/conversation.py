"""One chat with a model: the history, its chat format, the latent cache kept in step with it, streamed
UTF-8-safe text, per-turn stats. The library side of `cpumla chat`: it never prints, it yields events.

Multi-turn reuse. The cache holds the tokens of the last prompt and answer. A new turn renders the whole
conversation again (the format decides what history looks like) and tokenizes it *reusing the known
tokenization* of the text it shares with the last one (`_Chunks`): the model's own answer tokens, not
a re-encoding that could split differently. Then only the tokens past the longest common prefix with
the cache are prefilled (`engine.truncate`). When the conversation outgrows the context, the oldest
turns are dropped (a notice event) and the rest re-prefilled.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

from cpumla.chat.chat_format import ChatFormat, Message
from cpumla.chat.reuse import answer_pieces, ids_of, prompt_pieces, sync_cache
from cpumla.chat.stops import StopText, parse_stop
from cpumla.chat.tokenizer import IncrementalDecoder, Tokenizer
from cpumla.errors import CpumlaError
from cpumla.sampling import Sampler

PREFILL_CHUNK = 256     # tokens per prefill step: the granularity of progress and of stopping


@dataclass
class Settings:
    temperature: float = 0.6
    top_p: float = 0.95
    top_k: int = 0
    min_p: float = 0.0
    max_tokens: int = 1024
    think: bool = False
    seed: int | None = None
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: tuple[str, ...] = ()

    def sampling(self) -> dict:
        """The Sampler's arguments (as Engine.generate takes them)."""
        return dict(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p,
                    seed=self.seed, repeat_penalty=self.repeat_penalty, repeat_last_n=self.repeat_last_n,
                    presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty)

    def sampler(self) -> Sampler:
        return Sampler(**self.sampling())


def _seed(v) -> int | None:
    if isinstance(v, str) and v.strip().lower() in ("none", "off", "random"):
        return None
    return int(v)


SETTABLE = {"temperature": float, "top_p": float, "top_k": int, "min_p": float, "max_tokens": int, "think": bool,
            "seed": _seed, "repeat_penalty": float, "repeat_last_n": int, "presence_penalty": float,
            "frequency_penalty": float, "stop": parse_stop}
SHOWN = ("temperature", "top_p", "top_k", "min_p", "max_tokens", "think", "seed", "repeat_penalty",
         "repeat_last_n", "presence_penalty", "frequency_penalty", "stop")


@dataclass
class Event:
    kind: str     # "text" | "reasoning" | "notice" | "progress" (prefill: done of total tokens, seconds)
    text: str
    done: int = 0
    total: int = 0
    seconds: float = 0.0


@dataclass
class TurnStats:
    prompt_tokens: int = 0      # tokens prefilled this turn (new since the cache)
    cached_tokens: int = 0      # tokens of the prompt already in the cache
    prompt_s: float = 0.0
    gen_tokens: int = 0
    gen_s: float = 0.0
    stop: str = ""              # "eos" | "stop" (a stop string) | "max_tokens" | "interrupted" | "context"
    drafted: int = 0            # draft tokens verified (speculative decoding), and of them kept
    kept: int = 0
    forwards: int = 0           # decode forwards

    @property
    def prompt_tps(self) -> float:
        return self.prompt_tokens / self.prompt_s if self.prompt_s > 0 else 0.0

    @property
    def gen_tps(self) -> float:
        return self.gen_tokens / self.gen_s if self.gen_s > 0 else 0.0


@dataclass
class _Chunks:
    """Text with a known tokenization, as (text, ids) pieces cut at added tokens."""
    pieces: list[tuple[str, list[int]]] = field(default_factory=list)

    def ids(self) -> list[int]:
        return ids_of(self.pieces)


class Conversation:
    def __init__(self, engine, tokenizer: Tokenizer, fmt: ChatFormat, settings: Settings | None = None,
                 system: str | None = None, stop_ids=None):
        self.engine, self.tok, self.fmt = engine, tokenizer, fmt
        self.settings = settings or Settings()
        self.system = system or None
        self.history: list[Message] = []          # user/assistant turns, no system
        self._known = _Chunks()
        self._pending = _Chunks()
        self._prompt_thinks = False
        self._sampler = self.settings.sampler()
        self._stop_requested = False
        stops = {tokenizer.token_id(s) for s in fmt.stop_strings} | set(stop_ids or ())
        self.stop_ids = frozenset(i for i in stops if i is not None)
        self.think_start = tokenizer.token_id("<think>")
        self.think_end = tokenizer.token_id("</think>")
        self.last = TurnStats()
        self.turns = 0
        self.dropped_turns = 0

    # ---- settings ----
    def set(self, key: str, value) -> None:
        if key not in SETTABLE:
            raise CpumlaError(f"unknown setting '{key}' (settable: {', '.join(SETTABLE)})")
        if key == "think":
            value = _parse_bool(value)
            if value and not (self.fmt.think_switch or self.fmt.always_thinks):
                raise CpumlaError(f"{self.fmt.family} has no thinking mode")
            if not value and self.fmt.always_thinks:
                raise CpumlaError(f"{self.fmt.family} always thinks")
        else:
            try:
                value = SETTABLE[key](value)
            except (TypeError, ValueError):
                kind = {"_seed": "integer or none", "parse_stop": "text"}.get(SETTABLE[key].__name__,
                                                                               SETTABLE[key].__name__)
                raise CpumlaError(f"{key} wants a {kind}, not {value!r}") from None
        if key == "max_tokens" and value < 1:
            raise CpumlaError("max_tokens must be at least 1")
        old = getattr(self.settings, key)
        setattr(self.settings, key, value)
        try:
            self._sampler = self.settings.sampler()    # checks the ranges
        except CpumlaError:
            setattr(self.settings, key, old)
            raise

    def set_system(self, text: str | None) -> None:
        self.system = text or None

    def messages(self) -> list[Message]:
        return ([Message("system", self.system)] if self.system else []) + self.history

    # ---- turns ----
    def request_stop(self) -> None:
        """Stop the answer being generated after the current token (safe from a signal handler)."""
        self._stop_requested = True

    def clear(self) -> None:
        self.history.clear()
        self._known = _Chunks()
        self.engine.reset()
        self.last = TurnStats()
        self.turns = 0
        self.dropped_turns = 0

    def send(self, text: str) -> Iterator[Event]:
        """Add a user turn and stream the answer. Raises CpumlaError (history unchanged) when the
        prompt cannot be sent: empty, or longer than the context."""
        if not text.strip():
            raise CpumlaError("empty prompt")
        saved = (list(self.history), self.dropped_turns)
        self.history.append(Message("user", text))
        try:
            ids, notices = self._fit()
        except CpumlaError:
            self.history.pop()
            raise
        yield from notices
        yield from self._answer(ids, saved, new_turn=True)

    def regenerate(self) -> Iterator[Event]:
        """Drop the last answer and answer the last user turn again (not a new turn)."""
        saved = (list(self.history), self.dropped_turns)
        if self.history and self.history[-1].role == "assistant":
            self.history.pop()
        if not self.history:
            raise CpumlaError("nothing to regenerate")
        ids, notices = self._fit()
        yield from notices
        yield from self._answer(ids, saved, new_turn=False)

    # ---- internals ----
    def _prompt_ids(self) -> list[int]:
        text = self.fmt.render(self.messages(), think=self.settings.think or self.fmt.always_thinks)
        self._prompt_thinks = text.rstrip().endswith("<think>")   # the answer starts inside reasoning
        return self._tokenize(text)

    def _fit(self) -> tuple[list[int], list[Event]]:
        """The prompt ids, dropping the oldest turns while the prompt leaves too little room to answer."""
        ctx = self.engine.max_seq_len
        room = min(self.settings.max_tokens, max(1, ctx // 4))
        ids, dropped, saved = self._prompt_ids(), 0, list(self.history)
        while len(ids) + room > ctx and len(self.history) > 1:
            del self.history[:2 if self.history[0].role == "user" and len(self.history) > 2 else 1]
            while self.history and self.history[0].role != "user":
                del self.history[0]
            dropped += 1
            ids = self._prompt_ids()
        if len(ids) >= ctx:
            self.history[:] = saved           # a prompt that cannot fit costs the history nothing
            raise CpumlaError(f"the prompt is {len(ids)} tokens; the context holds {ctx} "
                              f"(a larger --ctx, or a shorter prompt)")
        bad = next((i for i in ids if i >= self.engine.config.vocab_size), None)
        if bad is not None:
            self.history[:] = saved
            raise CpumlaError(f"token id {bad} is outside the model's vocabulary ({self.engine.config.vocab_size}); "
                              f"the tokenizer does not belong to this model")
        self.dropped_turns += dropped
        notices = [Event("notice", f"context full ({ctx} tokens): dropped the {dropped} oldest turn"
                                   f"{'s' if dropped > 1 else ''} and re-read the rest")] if dropped else []
        return ids, notices

    def _tokenize(self, text: str) -> list[int]:
        """Ids of `text`, reusing the known pieces it starts with (the cache's own tokens)."""
        self._pending = _Chunks(prompt_pieces(self.tok, self._known.pieces, text))
        return self._pending.ids()

    def _sync_cache(self, ids: list[int]) -> int:
        return sync_cache(self.engine, ids)

    def _prefill(self, ids: list[int], cached: int, st: TurnStats) -> Iterator[Event]:
        """Runs ids[cached:] through the model in chunks, a progress event after each; returns the last
        logits, or None when stopped (the cache then holds only the first `cached` tokens)."""
        eng, total = self.engine, len(ids) - cached
        t0 = time.perf_counter()
        logits = None
        for c0 in range(cached, len(ids), PREFILL_CHUNK):
            if self._stop_requested:
                eng.truncate(cached)
                return None
            logits = eng.forward(ids[c0:c0 + PREFILL_CHUNK], last_only=True)
            done = min(len(ids), c0 + PREFILL_CHUNK) - cached
            st.prompt_s = time.perf_counter() - t0
            if total > PREFILL_CHUNK:
                yield Event("progress", "", done=done, total=total, seconds=st.prompt_s)
        return logits

    def _answer(self, ids: list[int], saved, new_turn: bool) -> Iterator[Event]:
        eng, st = self.engine, TurnStats()
        self.last = st
        self._stop_requested = False
        reasoning = self._prompt_thinks
        cached = self._sync_cache(ids)
        st.cached_tokens, st.prompt_tokens = cached, len(ids) - cached
        logits = yield from self._prefill(ids, cached, st)
        if logits is None:          # stopped while reading the prompt: as if the message was never sent
            self.history[:], self.dropped_turns = saved
            st.stop = "interrupted"
            yield Event("notice", "stopped while reading the prompt; the message was not sent")
            return
        self._sampler.start(ids)
        gen: list[int] = []
        dec = IncrementalDecoder(self.tok)
        stops = StopText(self.settings.stop)
        t1 = time.perf_counter()
        step = eng.stepper()
        try:
            while True:
                if self._stop_requested:
                    st.stop = "interrupted"
                    break
                tok = self._sampler(logits[-1])
                if tok in self.stop_ids:
                    st.stop = "eos"
                    break
                gen.append(tok)
                if tok in (self.think_start, self.think_end):
                    tail = stops.push(dec.flush()) + stops.flush()
                    if tail:
                        yield Event("reasoning" if reasoning else "text", tail)
                    reasoning = tok == self.think_start
                else:
                    piece = stops.push(dec.push(tok))
                    if piece:
                        yield Event("reasoning" if reasoning else "text", piece)
                if stops.hit is not None:
                    st.stop = "stop"
                    break
                if len(gen) >= self.settings.max_tokens:
                    st.stop = "max_tokens"
                    break
                if step.at >= eng.max_seq_len:
                    st.stop = "context"
                    break
                if self._stop_requested:
                    st.stop = "interrupted"
                    break
                logits = step(tok)[None]
        finally:
            step.close()         # drafts verified ahead and not kept leave the cache
            st.drafted, st.kept, st.forwards = step.verified, step.accepted, step.forwards
            # runs on normal end, on an interrupt and on an exception alike: history and the known
            # tokenization always describe what was generated, so the next turn stays consistent
            st.gen_tokens, st.gen_s = len(gen), time.perf_counter() - t1
            tail = "" if stops.hit is not None else stops.push(dec.flush()) + stops.flush()
            self._finish(gen, stops.hit)
            if new_turn:
                self.turns += 1
        if tail:
            yield Event("reasoning" if reasoning else "text", tail)
        if st.stop == "context":
            yield Event("notice", f"context full ({eng.max_seq_len} tokens): the answer was cut")

    def _finish(self, gen: list[int], stop_hit: str | None = None) -> None:
        """Record the answer in history (cut before a stop string that ended it) and its tokens as
        known pieces."""
        self._known = _Chunks(self._pending.pieces + answer_pieces(self.tok, gen))
        thinking, parts = self._prompt_thinks, {True: [], False: []}
        for t in gen:
            if t == self.think_start:
                thinking = True
            elif t == self.think_end:
                thinking = False
                parts[False] = []          # history keeps the answer after the last </think>
            else:
                parts[thinking].append(t)
        reasoning, answer = self.tok.decode(parts[True]), self.tok.decode(parts[False])
        if stop_hit is not None:
            if thinking:
                reasoning = reasoning.split(stop_hit, 1)[0]
            else:
                answer = answer.split(stop_hit, 1)[0]
        if self.fmt.family == "deepseek-v2" and answer.startswith(" "):
            answer = answer[1:]           # "Assistant:" then " answer"; history writes "Assistant: " + answer
        self.history.append(Message("assistant", answer, reasoning))


def _parse_bool(v) -> bool:
    if isinstance(v, bool):
        return v
    s = str(v).strip().lower()
    if s in ("1", "on", "true", "yes"):
        return True
    if s in ("0", "off", "false", "no"):
        return False
    raise CpumlaError(f"expected on or off, not {v!r}")
