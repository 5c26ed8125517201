"""The runtime for one conversation, whatever the family: positions, chunked prefill, truncate and
generate over a family model (cpumla/models), which owns its weights, its native forward and its
caches. Decode is a one-token forward."""

from __future__ import annotations

import threading

import numpy as np

from cpumla import native
from cpumla.errors import CpumlaError
from cpumla.models import PREFILL_CHUNK
from cpumla.runtime import speculative
from cpumla.runtime.memory import available_memory, gib
from cpumla.sampling import Sampler

BIG_LOGITS = 256 << 20  # logits buffers above this are checked against the available memory first


def context_length(cfg, max_seq_len) -> int:
    """The cache length: max_seq_len (an integer >= 1), or by default the model's
    max_position_embeddings capped at 4096."""
    if max_seq_len is None:
        return min(cfg.max_position_embeddings, 4096)
    if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, (int, np.integer)) or max_seq_len < 1:
        raise CpumlaError(f"max_seq_len must be an integer of at least 1, got {max_seq_len!r}")
    return int(max_seq_len)


def token_array(token_ids, vocab: int) -> np.ndarray:
    """token_ids (a Python int, a sequence of them, or a 1-D integer array) as contiguous int64, each
    checked against the vocabulary and reported as given when it is not in it."""
    if isinstance(token_ids, (bool, np.bool_)):
        raise CpumlaError("token ids must be integers, got a bool")
    try:
        arr = np.asarray(token_ids)
    except (ValueError, TypeError) as e:
        raise CpumlaError(f"token ids must be integers: {e}") from None
    if arr.dtype == object:
        if arr.ndim > 1 or not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool)
                                   for t in arr.reshape(-1)):
            raise CpumlaError("token ids must be integers")
    elif arr.dtype.kind not in "iu":
        raise CpumlaError(f"token ids must be integers, got {arr.dtype}")
    if arr.ndim > 1:
        raise CpumlaError(f"token ids must be one sequence, got shape {arr.shape}")
    arr = arr.reshape(-1)
    bad = [t for t in arr.tolist() if not 0 <= t < vocab]
    if bad:
        raise CpumlaError(f"token id {bad[0]} is outside the vocabulary of {vocab}")
    return np.ascontiguousarray(arr.astype(np.int64))


class Engine:
    """One conversation's model state. forward() appends to the cache. Calls on one engine are
    serialised by a lock; engines of different models in one process are independent."""

    def __init__(self, family, cfg, src, max_seq_len: int | None = None, threads: int | None = None, shard=None):
        native.ensure_init()
        if threads is not None:
            native.set_threads(threads)
        ctx = context_length(cfg, max_seq_len)
        self.config = cfg
        self.max_seq_len = ctx
        # shard: a tensor-parallel rank's part (runtime/tp.py), None in one process
        self.model = family.Model(cfg, src, ctx, min(PREFILL_CHUNK, ctx), shard=shard)
        self.ranks = None                # runtime.tp.Ranks on rank 0 of tensor parallel
        self._src = src                  # a checkpoint's mappings stay open while the engine lives
        self.stream = None               # its routed experts' ExpertStream when they are read from disk
        self._lock = threading.Lock()
        self._one = np.zeros(1, np.int64)     # the ids of a one-token forward (forward's fast path)
        self.pos = 0
        self.tokens: list[int] = []
        self._epoch = 0                  # counts the changes of the cache: a generator notices others'
        self.text = None                 # runtime.text.Text: the tokenizer and chat format, set by the loader
        self.drafter = None              # speculative decoding's drafter (set_draft), None: plain decode
        self.draft_tokens = 1

    # ---- public ----
    @property
    def matmul_format(self) -> str:
        """The weight format of the linear layers ("bf16", "e4m3", ...). bf16 means the products run
        on bf16-rounded activations (kernels.h)."""
        return self.model.matmul_format

    @property
    def bf16_activations(self) -> bool:
        """Whether the linear layers multiply bf16-rounded activations (kernels.h): bf16 weights, and
        FP8 (e4m3) weights, whose block scale is folded into the activation before the rounding."""
        return self.matmul_format in ("bf16", "e4m3")

    @property
    def rounded_activations(self) -> bool:
        """Whether the linear layers round their activations before the products: to bf16 (bf16 and
        FP8 weights) or to int8 per block of 32 (q8 / q4 weights, kernels.h)."""
        return self.matmul_format in ("bf16", "e4m3", "q8", "q4")

    @property
    def epoch(self) -> int:
        """Counts the changes of the cache (forward, truncate, reset): a loop notices others' by it."""
        return self._epoch

    @property
    def has_mtp(self) -> bool:
        """Whether the checkpoint's MTP layer is loaded (drafts with --draft mtp)."""
        return getattr(self.model, "mtp", None) is not None

    @property
    def draft(self) -> str:
        """The drafter in use: "mtp", "ngram" or "none"."""
        return {speculative.MtpDrafter: "mtp", speculative.NgramDrafter: "ngram"}.get(type(self.drafter), "none")

    def set_draft(self, mode: str | None = None, tokens: int = 1, p_min: float | None = None) -> None:
        """Speculative decoding for this engine's decode loops (stepper()): mode "mtp" (the checkpoint's
        MTP layer), "ngram" (prompt lookup), "none", or None: mtp where the checkpoint has the layer,
        else none. tokens: drafts verified per forward (K); p_min: an MTP draft below this probability is
        not proposed (None: where a draft pays by the bytes it reads, runtime/speculative.py). The cache
        is emptied (the MTP layer's entries start with it)."""
        speculative.check_draft(mode, tokens, p_min)
        if mode is None:
            mode = "mtp" if self.has_mtp else "none"
        if mode == "mtp" and not self.has_mtp:
            raise CpumlaError(f"--draft mtp: this checkpoint ({self.config.model_type}) has no MTP layer cpumla reads; "
                              "use --draft ngram or none")
        with self._lock:
            self.drafter = None if mode == "none" else speculative.MtpDrafter(self, p_min) if mode == "mtp" \
                else speculative.NgramDrafter(self)
            self.draft_tokens = int(tokens)
            self.pos, self.tokens = 0, []         # the MTP entries start with the cache
            self._epoch += 1

    def stepper(self) -> speculative.Stepper:
        """A decode loop's next-logits function, step(tok) -> row, drafting as set_draft says; close it
        (or use it in a with block) when the loop ends."""
        return speculative.Stepper(self, self.drafter, self.draft_tokens)

    def reset(self) -> None:
        with self._lock:
            self.pos = 0
            self.tokens = []
            self._epoch += 1
            if self.drafter is not None and hasattr(self.drafter, "truncated"):
                self.drafter.truncated(0)

    def truncate(self, n: int) -> None:
        """Forget everything after the first n cached tokens (multi-turn reuse, regenerate)."""
        with self._lock:
            self.pos = min(self.pos, max(0, n))
            del self.tokens[self.pos:]
            self._epoch += 1
            if self.drafter is not None and hasattr(self.drafter, "truncated"):
                self.drafter.truncated(self.pos)

    def close(self) -> None:
        """Frees the model's native state now; the engine cannot run afterwards."""
        with self._lock:
            if self.stream is not None:
                self.stream.close()
            self.model.close()

    def forward(self, token_ids, last_only: bool = False) -> np.ndarray:
        """Logits [n, vocab] (or [1, vocab] for the last position) of token_ids appended to the cache."""
        # Decode's call, [a Python int], takes a path of its own: between two tokens the weights'
        # stream has pushed numpy's code and data out of the caches, where token_array and the
        # generator below cost ~100 us a token. (type(): a bool is not an int here.)
        one = type(token_ids) in (list, tuple) and len(token_ids) == 1 and type(token_ids[0]) is int
        if not one:
            ids = token_array(token_ids, self.config.vocab_size)
            if ids.size == 0:
                raise CpumlaError("forward needs at least one token")
        elif not 0 <= token_ids[0] < self.config.vocab_size:
            raise CpumlaError(f"token id {token_ids[0]} is outside the vocabulary of {self.config.vocab_size}")
        with self._lock:
            if one:
                ids = self._one
                ids[0] = token_ids[0]
            n = ids.size
            if self.pos + n > self.max_seq_len:
                raise CpumlaError(f"context full: {self.pos} cached + {n} new tokens > max_seq_len {self.max_seq_len}")
            rows = 1 if last_only else n
            need = 4 * rows * self.config.vocab_size
            if need > BIG_LOGITS:
                avail, what = available_memory()
                if need > avail:
                    raise CpumlaError(f"the logits of {n} tokens need {gib(need)} but {gib(avail)} is available "
                                      f"({what}); pass last_only=True or fewer tokens")
            logits = np.empty((rows, self.config.vocab_size), np.float32)
            mtp = self.drafter if isinstance(self.drafter, speculative.MtpDrafter) else None
            # long prompts go in chunks, so the forward's scratch stays bounded
            for c0 in range(0, n, PREFILL_CHUNK):
                c1 = min(n, c0 + PREFILL_CHUNK)
                out = logits if last_only else logits[c0:]
                # on an error pos is unchanged: rows of earlier chunks are simply not counted
                if mtp is None:
                    self.model.forward(ids[c0:c1], self.pos + c0, out, last_only)
                    continue
                hidden = np.empty((c1 - c0, self.model.mtp_width), np.float32)
                self.model.forward_hidden(ids[c0:c1], self.pos + c0, out, last_only, hidden)
                mtp.after_forward(self.pos + c0, hidden, lambda a, b, c1=c1: (self.tokens + ids[:c1].tolist())[a:b])
            self.pos += n
            self._epoch += 1
            if one:
                self.tokens.append(token_ids[0])
            else:
                self.tokens.extend(ids.tolist())
        return logits

    # ---- text (runtime/text.py) ----
    def chat(self, messages, *, stream: bool = False, think: bool | None = None, tools=None,
             max_tokens: int | None = None, stop=None, **sampling):
        """The answer to a conversation (a string, or a list of {"role", "content"} dicts or chat_format
        Messages) in the model's chat format: a text.Reply (text, reasoning, tool_calls, finish, token
        counts), or with stream=True an iterator of text.Delta (text or reasoning as it arrives, then tool
        calls). think: thinking on or off where the model has the switch; tools: OpenAI-style function
        tools, described in the prompt and parsed out of the answer; sampling: temperature, top_p, top_k,
        min_p, seed. max_tokens None: up to the end of the context."""
        from cpumla.runtime import text

        return text.chat(self, messages, stream, think, tools, max_tokens, stop, sampling)

    def complete(self, prompt: str, *, stream: bool = False, max_tokens: int | None = None, stop=None, **sampling):
        """The continuation of raw text (BOS added), as chat() returns or streams it."""
        from cpumla.runtime import text

        return text.complete(self, prompt, stream, max_tokens, stop, sampling)

    def text_generator(self):
        """The chat.generate.Generator of this engine (its tokenizer loaded on first use)."""
        if self.text is None:
            raise CpumlaError("this engine has no tokenizer: load it with cpumla.load() for chat() / complete()")
        return self.text.generator(self)

    def generate(self, prompt_ids, max_new_tokens: int, stop_ids=None, **sampling):
        """An iterator of generated token ids; the prompt is appended to the cache first. sampling: the
        arguments of cpumla.sampling.Sampler (temperature, top_k, top_p, min_p, seed,
        repeat_penalty, repeat_last_n, presence_penalty, frequency_penalty). Its arguments are checked
        here, before anything runs (CpumlaError). A reset, truncate or forward of this engine by
        anyone else while it runs ends it: its next step raises CpumlaError rather than continue from
        a cache that is no longer its own."""
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 0:
            raise CpumlaError(f"max_new_tokens must be an integer >= 0, not {max_new_tokens!r}")
        sampler = Sampler(**sampling)
        stops = set(self.config.eos_ids if stop_ids is None else stop_ids)
        return self._generate(prompt_ids, int(max_new_tokens), sampler, stops)

    def _generate(self, prompt_ids, max_new_tokens: int, sampler, stops):
        sampler.start(prompt_ids)
        row = self.forward(prompt_ids, last_only=True)[-1]
        mine = self._epoch
        with self.stepper() as step:
            for _ in range(max_new_tokens):
                tok = sampler(row)
                yield tok
                if tok in stops or step.at >= self.max_seq_len:
                    return
                if self._epoch != mine:
                    raise CpumlaError("the engine's cache was changed (reset, truncate or another forward) while "
                                      "this generation ran: it stops here")
                row = step(tok)
                mine = self._epoch
