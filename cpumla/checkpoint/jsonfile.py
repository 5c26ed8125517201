"""JSON as cpumla reads it from files and flags (configs, safetensors headers and indexes, overrides):
every failure one CpumlaError line naming the file, and nesting bounded before Python's recursion is."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from cpumla.errors import CpumlaError


def read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object in a file (a config.json, a preset); any problem is one CpumlaError line naming it."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise CpumlaError(f"{path}: cannot read: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise CpumlaError(f"{path}: not UTF-8 text: {e}") from None
    value = parse_json(text, str(path))
    if not isinstance(value, dict):
        raise CpumlaError(f"{path}: is a JSON {type(value).__name__}, not an object")
    return value


MAX_JSON_DEPTH = 64     # configs, indexes, headers and overrides nest a few levels; deeper is not ours


def check_depth(value: Any, what: str, limit: int = MAX_JSON_DEPTH) -> None:
    """CpumlaError when containers in value nest deeper than limit (walked without recursion)."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, (dict, list)):
            if depth > limit:
                raise CpumlaError(f"{what}: nested more than {limit} levels deep")
            stack.extend((c, depth + 1) for c in (v.values() if isinstance(v, dict) else v))


def parse_json(text: str | bytes, what: str, bad: str = "invalid JSON", **kw) -> Any:
    """json.loads with every failure as one CpumlaError line, "{what}: {bad} ...": bad syntax (with line
    and column), nesting past Python's recursion limit or MAX_JSON_DEPTH, integers too long to convert."""
    try:
        value = json.loads(text, **kw)
    except json.JSONDecodeError as e:
        raise CpumlaError(f"{what}: {bad} at line {e.lineno} column {e.colno}: {e.msg}") from None
    except RecursionError:
        raise CpumlaError(f"{what}: nested more than {MAX_JSON_DEPTH} levels deep") from None
    except (ValueError, UnicodeDecodeError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise CpumlaError(f"{what}: {bad}: {msg}") from None
    check_depth(value, what)
    return value
