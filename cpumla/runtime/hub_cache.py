"""Where the Hugging Face hub cache is, read from the environment at each call (huggingface_hub reads it
once, at import)."""

from __future__ import annotations

import os
from pathlib import Path


def hf_hub_cache() -> Path:
    """The hub cache directory, read from the environment now (huggingface_hub reads it at import)."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.environ[var]).expanduser()
    return hf_home() / "hub"


def hf_home() -> Path:
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
    return Path(xdg, "huggingface").expanduser()
