"""tokenizer_config.json, as both tokenizers (tokenizer.json's and Moonlight's tiktoken) read it."""

from __future__ import annotations

import json
from pathlib import Path

from cpumla.errors import CpumlaError


def read_tokenizer_config(path: Path) -> dict:
    """tokenizer_config.json's object: {} when the file is absent or holds no object."""
    if not path.is_file():
        return {}
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CpumlaError(f"{path}: cannot read: {e}") from None
    return d if isinstance(d, dict) else {}


def token_str(t) -> str | None:
    """A special token as tokenizer_config.json gives it (a string, or an object with `content`)."""
    if isinstance(t, dict):
        t = t.get("content")
    return t if isinstance(t, str) and t else None
