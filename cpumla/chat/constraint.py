"""Constrained decoding through llguidance: a grammar (a JSON schema, or a Lark grammar from tools.py) and
the tokenizer give, before each token, the set of tokens that keep the output inside the grammar; the
logits outside it are set to -inf before sampling. llguidance computes that mask for a 129k vocabulary in
microseconds (benchmarks/structured.py measures it), and builds its view of the tokenizer once per model
(about 0.7 s, cached here)."""

from __future__ import annotations

import threading

import numpy as np

from cpumla.errors import CpumlaError

_CACHE: dict[int, object] = {}
_LOCK = threading.Lock()


def _llg():
    try:
        import llguidance
    except ImportError:
        raise CpumlaError("structured output needs the package llguidance (pip install llguidance)") from None
    return llguidance


def ll_tokenizer(tok, n_vocab: int):
    """llguidance's tokenizer for a cpumla Tokenizer, built once per (tokenizer, vocabulary size)."""
    llg = _llg()
    key = (id(tok), n_vocab)
    with _LOCK:
        got = _CACHE.get(key)
        if got is None:
            to_json = getattr(tok, "to_json", None)
            if to_json is None:
                raise CpumlaError(f"structured output is not available with this tokenizer ({tok.source})")
            eos = tok.token_id(tok.eos_token) if tok.eos_token else None
            got = _CACHE[key] = llg.LLTokenizer(to_json(), n_vocab=n_vocab, eos_token=eos)
        return got


def schema_grammar(schema: dict, style: dict | None = None) -> str:
    """A JSON schema as an llguidance grammar. Raises CpumlaError naming what llguidance refuses (it
    refuses unknown keywords rather than ignoring them)."""
    llg = _llg()
    try:
        return llg.LLMatcher.grammar_from_json_schema(schema, overrides=style or None)
    except ValueError as e:
        raise CpumlaError(f"the JSON schema is not usable: {e}") from None


def lark_grammar(lark: str) -> str:
    return _llg().LLMatcher.grammar_from_lark(lark)


def check_grammar(grammar: str, what: str) -> None:
    """CpumlaError with llguidance's reason when the grammar does not compile (unsupported schema
    features included)."""
    err = _llg().LLMatcher.validate_grammar(grammar)
    if err:
        raise CpumlaError(f"{what}: {err.strip().splitlines()[0]}")


class Constraint:
    """One generation's matcher: mask the logits, then advance with the sampled token."""

    def __init__(self, tok, n_vocab: int, grammar: str):
        llg = _llg()
        self.n_vocab = n_vocab
        self.matcher = llg.LLMatcher(ll_tokenizer(tok, n_vocab), grammar, log_level=0)
        if self.matcher.is_error():
            raise CpumlaError(f"the grammar does not compile: {self.matcher.get_error()}")
        self._mask = np.zeros((n_vocab + 31) // 32, np.int32)

    def apply(self, logits: np.ndarray) -> np.ndarray:
        """The logits with every token the grammar forbids at -inf (a copy)."""
        m = self.matcher
        m.unsafe_compute_mask_ptr(self._mask.ctypes.data, self._mask.nbytes)
        allowed = np.unpackbits(self._mask.view(np.uint8), bitorder="little")[: logits.shape[-1]].astype(bool)
        out = np.array(logits, dtype=np.float32, copy=True)
        out[~allowed] = -np.inf
        return out

    def advance(self, token: int) -> None:
        if not self.matcher.consume_token(int(token)):
            raise CpumlaError(f"the grammar refused token {token}: {self.matcher.get_error()}")

    @property
    def done(self) -> bool:
        """The grammar is complete and allows nothing more."""
        return self.matcher.is_stopped()

    @property
    def accepting(self) -> bool:
        return self.matcher.is_accepting()
