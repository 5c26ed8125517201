"""The served model: a chat.generate.Generator (one engine, its tokenizer and chat format, generation as
a blocking job on the server's one worker thread reporting through a callback; app.py turns the reports
into responses) and the names it answers to."""

from __future__ import annotations

from cpumla.chat.chat_format import ChatFormat
from cpumla.chat.generate import Generator, Job, Prompt, Sampling, Stats
from cpumla.chat.tokenizer import Tokenizer

__all__ = ["Job", "Prompt", "Sampling", "ServedModel", "Stats", "load_served"]


class ServedModel(Generator):
    def __init__(self, engine, tokenizer: Tokenizer, fmt: ChatFormat, stop_ids, name: str, aliases=()):
        super().__init__(engine, tokenizer, fmt, stop_ids)
        self.name = aliases[0] if aliases else name
        self.names = tuple(aliases) if aliases else (name,)


def load_served(model: str, *, dummy_weights: bool = False, hf_overrides=None, dummy_dtype: str = "bf16",
                seed: int = 0, threads: int | None = None, ctx: int | None = None,
                tokenizer: str | None = None, quant: str | None = None,
                progress=None, memory: int | None = None, aliases=(),
                draft=(None, 1, None)) -> tuple[ServedModel, list[str]]:
    """(ServedModel, notices): the engine, tokenizer and chat format as `cpumla chat` sets them up
    (a dummy model's vocabulary grows to fit the tokenizer); draft: (mode, tokens, MTP file or
    None) of speculative decoding (cpumla.load's draft, draft_tokens, draft_model). Raises CpumlaError."""
    from cpumla.chat.tokenizer import load_tokenizer
    from cpumla.runtime.loader import load
    from cpumla.runtime.resolve import load_config
    from cpumla.runtime.speculative import mtp_source

    overrides = dict(hf_overrides or {})
    mode, tokens, draft_model = (tuple(draft) + (None,))[:3]
    cfg, resolved = load_config(model, overrides, mtp=mtp_source(mode, draft_model))
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
                         resolved=resolved, memory=memory, draft=mode, draft_tokens=tokens,
                         draft_model=draft_model)
    return ServedModel.of(engine, tok, resolved.name or model, model, aliases), notices
