"""Model families, one module per Hugging Face `model_type`.

A family module owns everything specific to it: its config (HF field names), the tensors it reads
from a checkpoint and their quirks, building its layers (routing included), its native description
and state, and the bytes and FLOPs per token that `cpumla bench` reports. The runtime only sees the
module's `Config` and `Model` (see `Model` in deepseek_v2.py for the interface). Adding a family is
one Python module here, one C file in the kernel library's models/ with its header in include/,
presets and parity tests.
"""

from __future__ import annotations

import importlib

from cpumla.errors import CpumlaError
from cpumla.models.native_model import PREFILL_CHUNK  # noqa: F401  (the runtime's chunk, the models' scratch)

# model_type -> module under cpumla.models
FAMILIES = {
    "deepseek_v2": "deepseek_v2",      # V2, V2-Lite, V2.5, Coder-V2
    "deepseek_v3": "deepseek_v2",      # V3, R1, V3.1, Moonlight
    "deepseek_v32": "deepseek_v32",    # V3.2-Exp, V3.2
    "deepseek_v4": "deepseek_v4",      # V4-Flash, V4-Pro
}
NOT_YET: dict[str, str] = {}


def family(model_type, source: str = "config.json"):
    """The module serving model_type; CpumlaError (naming source) for anything else."""
    if isinstance(model_type, str) and model_type in NOT_YET:
        raise CpumlaError(f"{source}: model_type '{model_type}' ({NOT_YET[model_type]}) is not supported yet")
    if not isinstance(model_type, str) or model_type not in FAMILIES:
        raise CpumlaError(f"{source}: unsupported model_type {model_type!r} (supported: {', '.join(FAMILIES)})")
    return importlib.import_module(f"cpumla.models.{FAMILIES[model_type]}")


def config_from_dict(d, source: str = "config.json"):
    """The family config of a config.json dict."""
    if not isinstance(d, dict):
        raise CpumlaError(f"{source}: expected a JSON object")
    return family(d.get("model_type"), source).Config.from_dict(d, source)
