"""--hf-overrides: the one place JSON text becomes the dict the library takes (cpumla.load(hf_overrides=))."""

from __future__ import annotations

import json
from typing import Any

from cpumla.checkpoint.jsonfile import MAX_JSON_DEPTH, check_depth
from cpumla.errors import CpumlaError


def parse_hf_overrides(text: str | None) -> dict[str, Any]:
    """--hf-overrides JSON text as a dict ({} for none or blank); bad input is one CpumlaError line."""
    if text is None or not text.strip():
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise CpumlaError(f"--hf-overrides is not valid JSON: {e.msg} at column {e.colno}") from None
    except RecursionError:
        raise CpumlaError(f"--hf-overrides: nested more than {MAX_JSON_DEPTH} levels deep") from None
    except ValueError as e:                      # an integer too long to convert, ...
        raise CpumlaError(f"--hf-overrides is not valid JSON: {str(e).splitlines()[0]}") from None
    check_depth(value, "--hf-overrides")
    if not isinstance(value, dict):
        raise CpumlaError(f"--hf-overrides must be a JSON object, not a {type(value).__name__}")
    return value
