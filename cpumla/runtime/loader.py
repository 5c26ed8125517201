"""cpumla.load(): model argument -> config (+ overrides) -> weights (checkpoint or dummy) -> Engine."""

from __future__ import annotations

from cpumla.errors import CpumlaError
from cpumla.models import config_from_dict, family


def load_config(model: str, hf_overrides=None):
    """(family config, Resolved) for a local directory, a cached repo id or a preset."""
    from cpumla.runtime.resolve import apply_overrides, check_overrides, resolve_model

    resolved = resolve_model(model)
    where = f"{resolved.directory / 'config.json'}" if resolved.directory else f"preset {model}"
    cfg_dict = apply_overrides(resolved.config, hf_overrides)
    fit = getattr(family(cfg_dict.get("model_type"), where), "fit_overrides", None)
    if fit is not None:
        cfg_dict = fit(cfg_dict, check_overrides(hf_overrides))
    return config_from_dict(cfg_dict, source=where), resolved


def load(model: str, *, dummy_weights: bool = False, hf_overrides=None, seed: int = 0, threads: int | None = None,
         max_seq_len: int | None = None, dummy_dtype: str = "bf16", quant: str | None = None, progress=None):
    """An Engine for `model` (a local directory, a Hugging Face repo id in the local cache, or a known
    repo id whose config cpumla bundles). dummy_weights: deterministic random weights from `seed` in
    the checkpoint's in-memory formats (dummy_dtype "bf16", or "fp8" as V3 ships). quant "q8" / "q4":
    quantize the linear layers as they load (runtime/weights.py: quant_plan says which), calling
    progress(done, total) (elements) as it goes. Raises CpumlaError."""
    from cpumla import native
    from cpumla.runtime.engine import Engine
    from cpumla.runtime.weights import DummySource, Quantizer, quantized_as

    if threads is not None:        # quantizing runs on the pool: size it first
        native.ensure_init()
        native.set_threads(threads)
    quantizer = Quantizer(quant, progress) if quant is not None else None
    cfg, resolved = load_config(model, hf_overrides)
    fam = family(cfg.model_type)
    if quantizer is not None:
        if quantized_as(cfg):
            raise CpumlaError(f"{model} is already quantized ({quantized_as(cfg)}): leave out --quant")
        if not getattr(fam, "QUANTIZABLE", True):
            raise CpumlaError(f"--quant is not supported for {cfg.model_type} yet")
    if dummy_weights:
        src = DummySource(fam.tensors(cfg), cfg.block, seed=seed, dtype=dummy_dtype)
    else:
        if resolved.directory is None:
            raise CpumlaError(f"'{model}' is a preset (config only): pass --dummy-weights, or download the "
                              f"weights with `cpumla download {model}`")
        from cpumla.runtime.safetensors import Checkpoint

        src = Checkpoint(resolved.directory)
    if quantizer is not None:
        quantizer.plan_total(src, fam.tensors(cfg))
        src.quantizer = quantizer
    return Engine(fam, cfg, src, max_seq_len=max_seq_len, threads=threads)
