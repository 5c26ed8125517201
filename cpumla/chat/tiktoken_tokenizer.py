"""Moonlight's tokenizer: a tiktoken BPE file (`tiktoken.model`, 163,584 ranks) with the special tokens
of tokenizer_config.json's added_tokens_decoder (ids 163,584 on; the vocabulary is 163,840), split by
Moonshot's pre-tokenizer pattern. It offers what cpumla.chat.tokenizer.Tokenizer offers, so the
conversation, the formats and the incremental detokenizer use either alike.

For a Moonlight preset on dummy weights (no tokenizer file anywhere) `synthetic()` stands in: byte
tokens, then printable two- and three-character tokens up to 163,584 ranks, and Moonlight's special
tokens by name, so prompts carry the real chat format and answers read as text.
"""

from __future__ import annotations

import base64
import binascii
import re
from itertools import product
from pathlib import Path

from cpumla.chat.tokenizer_config import read_tokenizer_config, token_str
from cpumla.errors import CpumlaError

# Moonshot's pre-tokenizer pattern (tokenization_moonshot.py): Han runs, words, 1-3 digits, punctuation,
# newlines, spaces.
PAT_STR = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
NUM_RESERVED = 256
BASE_RANKS = 163584
SPECIALS = ["[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>"]


class _Added:
    def __init__(self, content: str, special: bool):
        self.content, self.special = content, special


class TiktokenTokenizer:
    def __init__(self, ranks: dict[bytes, int], added: dict[int, _Added], config: dict, source: str,
                 bundled: bool = False):
        try:
            import tiktoken
        except ImportError:
            raise CpumlaError("Moonlight's tokenizer needs the package tiktoken (pip install tiktoken)") from None
        n = len(ranks)
        first = max(n, min(added, default=n))
        for i in range(first, first + NUM_RESERVED):   # special ids left unnamed, as Moonshot's tokenizer does
            added.setdefault(i, _Added(f"<|reserved_token_{i}|>", True))
        self._enc = tiktoken.Encoding("moonlight", pat_str=PAT_STR, mergeable_ranks=ranks,
                                      special_tokens={a.content: i for i, a in added.items()})
        self._ids = {a.content: i for i, a in added.items()}
        self.config = config
        self.source = source
        self.bundled = bundled
        self._n_ranks = n
        self.vocab_size = max(n, max(added) + 1)
        self.added_ids = frozenset(added)
        self.special_ids = frozenset(i for i, a in added.items() if a.special)
        contents = sorted(self._ids, key=len, reverse=True)
        self._added_re = re.compile("(" + "|".join(map(re.escape, contents)) + ")")
        self.bos_token = token_str(config.get("bos_token")) or "[BOS]"
        self.eos_token = token_str(config.get("eos_token")) or "[EOS]"
        tpl = config.get("chat_template")
        self.chat_template = tpl if isinstance(tpl, str) and tpl.strip() else None

    @classmethod
    def from_dir(cls, directory: Path) -> "TiktokenTokenizer":
        path = Path(directory) / "tiktoken.model"
        config = read_tokenizer_config(Path(directory) / "tokenizer_config.json")
        ranks = _read_bpe(path)
        if sorted(ranks.values()) != list(range(len(ranks))):
            raise CpumlaError(f"{path}: ranks are not 0..{len(ranks) - 1}")
        added = {}
        decoder = config.get("added_tokens_decoder") or {}
        if not isinstance(decoder, dict):
            raise CpumlaError(f"{directory}/tokenizer_config.json: added_tokens_decoder is not an object")
        for k, v in decoder.items():
            try:
                i = int(k)
            except ValueError:
                raise CpumlaError(f"{directory}/tokenizer_config.json: added token id '{k}' is not a number") from None
            content = v.get("content") if isinstance(v, dict) else None
            if not isinstance(content, str) or not content:
                raise CpumlaError(f"{directory}/tokenizer_config.json: added token {i} has no content")
            if i < len(ranks):
                raise CpumlaError(f"{directory}/tokenizer_config.json: added token {i} overlaps the BPE ranks "
                                  f"(0..{len(ranks) - 1})")
            added[i] = _Added(content, bool(v.get("special", True)))
        return cls(ranks, added, config, f"{directory} (tiktoken)")

    @classmethod
    def synthetic(cls) -> "TiktokenTokenizer":
        """The stand-in for Moonlight presets on dummy weights (module docstring)."""
        ranks = {bytes([b]): b for b in range(256)}
        printable = [bytes([c]) for c in range(32, 127)]
        for length in (2, 3):
            for parts in product(printable, repeat=length):
                if len(ranks) == BASE_RANKS:
                    break
                ranks.setdefault(b"".join(parts), len(ranks))
        added = {BASE_RANKS + i: _Added(s, True) for i, s in enumerate(SPECIALS)}
        return cls(ranks, added, {}, "synthetic Moonlight stand-in (dummy weights)", bundled=True)

    def encode(self, text: str) -> list[int]:
        return self._enc.encode(text, allowed_special="all", disallowed_special=())

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        ids = [int(i) for i in ids]
        if skip_special_tokens:
            ids = [i for i in ids if i not in self.special_ids]
        ids = [i for i in ids if 0 <= i < self._n_ranks or i in self.added_ids]   # a gap decodes to nothing
        return self._enc.decode(ids, errors="replace")

    def token_id(self, token: str) -> int | None:
        if token in self._ids:
            return self._ids[token]
        try:
            return self._enc.encode_single_token(token.encode("utf-8"))
        except KeyError:
            return None

    def split_added(self, text: str) -> list[str]:
        return [p for p in self._added_re.split(text) if p]


def _read_bpe(path: Path) -> dict[bytes, int]:
    """The "base64-token rank" lines of a tiktoken file. Read here rather than by
    tiktoken.load.load_tiktoken_bpe, which caches every file it reads in a temporary directory keyed
    by its path, so a file changed in place would be read stale."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise CpumlaError(f"{path}: cannot read: {e.strerror}") from None
    ranks = {}
    for n, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except (ValueError, binascii.Error):
            raise CpumlaError(f"{path}: line {n} is not 'base64-token rank': not a tiktoken BPE file") from None
    if not ranks:
        raise CpumlaError(f"{path}: empty: not a tiktoken BPE file")
    return ranks
