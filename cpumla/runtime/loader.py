"""cpumla.load(): model argument -> config (+ overrides) -> weights (checkpoint or dummy) -> Engine."""

from __future__ import annotations

from cpumla.errors import CpumlaError
from cpumla.models.deepseek_v2 import MLAConfig


def load_config(model: str, hf_overrides=None):
    """(MLAConfig, Resolved) for a local directory, a cached repo id or a preset."""
    from cpumla.runtime.resolve import apply_overrides, resolve_model

    resolved = resolve_model(model)
    cfg_dict = fit_shrunk_moe(apply_overrides(resolved.config, hf_overrides), hf_overrides)
    where = f"{resolved.directory / 'config.json'}" if resolved.directory else f"preset {model}"
    return MLAConfig.from_dict(cfg_dict, source=where), resolved


def fit_shrunk_moe(cfg: dict, overrides) -> dict:
    """vLLM-style shrinking (`{"n_routed_experts": 4}` on V2-Lite's top-6) leaves routing settings the
    smaller expert count cannot satisfy; fit them, as vLLM's dummy runs do: top_k <= experts, and groups
    that divide the experts (at least two per group for the top-2 group score). Only when the overrides
    changed the expert count: a real config that is inconsistent stays an error."""
    from cpumla.runtime.resolve import check_overrides

    ov = check_overrides(overrides)
    if "n_routed_experts" not in ov or not cfg.get("n_routed_experts"):
        return cfg
    E = int(cfg["n_routed_experts"])
    if cfg.get("num_experts_per_tok") and "num_experts_per_tok" not in ov:
        cfg["num_experts_per_tok"] = min(int(cfg["num_experts_per_tok"]), E)
    g = cfg.get("n_group") or 1
    if g > 1 and "n_group" not in ov:
        min_per = 2 if cfg.get("model_type") == "deepseek_v3" else 1
        g = max([d for d in range(1, g + 1) if E % d == 0 and E // d >= min_per] or [1])
        cfg["n_group"] = g
        cfg["topk_group"] = min(int(cfg.get("topk_group") or 1), g)
    return cfg


def load(model: str, *, dummy_weights: bool = False, hf_overrides=None, seed: int = 0, threads: int | None = None,
         max_seq_len: int | None = None, dummy_dtype: str = "bf16"):
    """An Engine for `model` (a local directory, a Hugging Face repo id in the local cache, or a known
    repo id whose config cpumla bundles). dummy_weights: deterministic random weights from `seed` in
    the checkpoint's in-memory formats (dummy_dtype "bf16", or "fp8" as V3 ships). Raises CpumlaError."""
    from cpumla.runtime.engine import Engine
    from cpumla.runtime.weights import DummySource

    cfg, resolved = load_config(model, hf_overrides)
    if dummy_weights:
        src = DummySource(cfg, seed=seed, dtype=dummy_dtype)
    else:
        if resolved.directory is None:
            raise CpumlaError(f"'{model}' is a preset (config only): pass --dummy-weights, or download the "
                              f"weights with `cpumla download {model}`")
        from cpumla.runtime.safetensors import Checkpoint

        src = Checkpoint(resolved.directory)
    return Engine(cfg, src, max_seq_len=max_seq_len, threads=threads)
