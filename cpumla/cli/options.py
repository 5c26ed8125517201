"""Checks of options several commands share, so that each is one rule everywhere: RULES names the rule
of every numeric option by its parameter name, and `checked` applies them to a command before its body
runs (main.py wraps every command with it; tests/cli/test_options.py fails on an option without one)."""

from __future__ import annotations

import functools
import inspect
import math
import os
import re

from cpumla.errors import CpumlaError


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def check_threads(threads, flag: str = "--threads") -> list[str]:
    """None (one thread per core) or counts >= 1; returns warnings for counts above the cores here."""
    if threads is None:
        return []
    counts = threads if isinstance(threads, (list, tuple)) else [threads]
    if not counts or min(counts) < 1:
        raise CpumlaError(f"{flag} must be at least 1 (leave it out for one thread per core)")
    from cpumla.native import MAX_THREADS

    if max(counts) > MAX_THREADS:
        raise CpumlaError(f"{flag} {max(counts)} is more than the thread pool's {MAX_THREADS}")
    n = cores()
    return [f"{t} threads is more than the {n} cores here; running anyway" for t in counts if t > n]


def check_ctx(ctx, trained: int) -> list[str]:
    """--ctx: None (the default), or >= 1; a warning above the model's trained length."""
    if ctx is None:
        return []
    if ctx < 1:
        raise CpumlaError("--ctx must be at least 1 (leave it out for min(the model's, 4096))")
    if ctx > trained:
        return [f"--ctx {ctx} is above the {trained} tokens the model was trained for; "
                f"answers past that are unreliable"]
    return []


def check_seed(seed, flag: str = "--seed") -> None:
    from cpumla.sampling import check_seed as rule

    rule(seed, flag)


def dummy_dtypes_help() -> str:
    from cpumla.checkpoint.dummy import DUMMY_DTYPES

    return ", ".join(DUMMY_DTYPES[:-1]) + " or " + DUMMY_DTYPES[-1]


QUANT_HELP = "Quantize the linear layers as they load: q8 (8.5 bits a weight) or q4 (4.5)."


def check_draft(draft, tokens, draft_model=None) -> None:
    """--draft, --draft-tokens and --draft-model, before a model loads (runtime/speculative.py:
    mtp_source refuses --draft-model with another mode)."""
    from cpumla.runtime.speculative import DRAFTS, MAX_DRAFT_TOKENS, mtp_source

    if draft is not None and draft not in DRAFTS:
        raise CpumlaError(f"--draft must be one of {', '.join(DRAFTS)}, not '{draft}'")
    if not 1 <= tokens <= MAX_DRAFT_TOKENS:
        raise CpumlaError(f"--draft-tokens must be from 1 to {MAX_DRAFT_TOKENS}, not {tokens}")
    mtp_source(draft, draft_model)


def check_quant(quant) -> None:
    """--quant: None, q8 or q4."""
    from cpumla.checkpoint.formats import QUANTS

    if quant is not None and quant not in QUANTS:
        raise CpumlaError(f"--quant must be one of {', '.join(QUANTS)}, not '{quant}'")


MEMORY_HELP = ("Memory budget, e.g. 16G (K, M, G, T: powers of 1024; default: what this process may use). A "
               "checkpoint larger than it keeps its routed experts on disk and reads those each token uses.")
DRAFT_HELP = ("Speculative decoding: mtp (the checkpoint's multi-token-prediction layer drafts; the default "
              "where it has one), ngram (prompt lookup: the continuation of an earlier occurrence), none.")
DRAFT_TOKENS_HELP = "Draft tokens verified in one forward (1 to 8)."
DRAFT_MODEL_HELP = ("A GGUF model's MTP file (llama.cpp's converter with --mtp), drafting with mtp. Default: the "
                    "one beside the model, named mtp- and the model's file name.")
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


TP_HELP = ("Tensor-parallel ranks: start N processes on this machine, each holding 1/N of the heads, experts' "
           "intermediate dimension and vocabulary (one NUMA node or an equal slice of the cores each; --threads "
           "is per rank). Under torchrun leave it out: the launch's ranks are used.")


def apply_tp(tp) -> None:
    """--tp N: the loads of this command start N ranks (cpumla.load's tp, through CPUMLA_TP)."""
    if tp is None:
        return
    _ranks(tp, "--tp")
    import os

    os.environ["CPUMLA_TP"] = str(tp)


def parse_size(text, flag: str = "--memory") -> int | None:
    """A byte count as the user writes it: 16G, 1.5T, 512MiB, 24GB, 800000000 (K/M/G/T: powers of 1024)."""
    if text is None:
        return None
    m = re.fullmatch(r"(\d+(?:\.\d*)?)\s*([KMGT]?)(?:I?B)?", str(text).strip().upper())
    v = int(float(m[1]) * _UNITS[m[2]]) if m else 0
    if v < 1:
        raise CpumlaError(f"{flag} must be a size such as 16G, 512M or a byte count, not {text!r}")
    return v


def _at_least(lo: int):
    def rule(v, flag: str) -> None:
        if v < lo:
            raise CpumlaError(f"{flag} must be at least {lo}, not {v}")
    return rule


def _port(v, flag: str) -> None:
    if not 0 <= v <= 65535:
        raise CpumlaError(f"{flag} must be in 0..65535, not {v}")


def _positive_real(v, flag: str) -> None:
    if not (math.isfinite(v) and v > 0):
        raise CpumlaError(f"{flag} must be a finite number above 0, not {v}")


def _threads(v, flag: str) -> None:
    if isinstance(v, int):            # bench's is a comma-separated list, checked once parsed
        check_threads(v, flag)


def _ranks(v, flag: str) -> None:
    if not 1 <= v <= 64:
        raise CpumlaError(f"{flag} must be from 1 to 64 ranks, not {v}")


RULES = {
    "threads": _threads, "seed": check_seed, "ctx": _at_least(1), "ctx_size": _at_least(2), "port": _port,
    "max_queue": _at_least(0), "max_tokens": _at_least(1), "seconds": _positive_real, "n_prompt": _at_least(0),
    "n_gen": _at_least(0), "reps": _at_least(1), "rows": _at_least(1), "cols": _at_least(1),
    "stream_mb": _at_least(1), "prompt_tokens": _at_least(1), "decode_tokens": _at_least(1),
    "draft_tokens": _at_least(1), "tp": _ranks,
}
# the sampling options: the sampler's one rule (cpumla.sampling), for `chat` and the server alike
SAMPLER_OPTIONS = ("temperature", "top_p", "top_k", "min_p", "repeat_penalty", "repeat_last_n", "presence_penalty",
                   "frequency_penalty")


def flag_of(param: inspect.Parameter) -> str:
    """The option's long flag as the user types it (its parameter name for an argument)."""
    decls = getattr(param.default, "param_decls", None) or ()
    return next((d for d in decls if d.startswith("--")), decls[0] if decls else param.name)


def checked(command):
    """The command with RULES applied to its options before it runs."""
    flags = {name: flag_of(p) for name, p in inspect.signature(command).parameters.items()}

    @functools.wraps(command)
    def run(**kwargs):
        for name, v in kwargs.items():
            rule = RULES.get(name)
            if rule is not None and v is not None and not isinstance(v, (str, bool)):
                rule(v, flags[name])
        return command(**kwargs)
    return run
