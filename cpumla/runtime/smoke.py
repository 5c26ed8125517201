"""Smoke runs: load a model (real or dummy weights), prefill, decode, and check that the logits are
finite and that cached decode matches one full forward over the same tokens."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from cpumla.errors import CpumlaError

# The default set: real configs of each family, shrunk in width and depth (MLA dims kept real).
DEFAULT_MODELS = {
    "deepseek-ai/DeepSeek-V2-Lite": {},
    "deepseek-ai/DeepSeek-V2": {"q_lora_rank": 192},
    "deepseek-ai/DeepSeek-V3": {"q_lora_rank": 192},
    "deepseek-ai/DeepSeek-V3.2": {"q_lora_rank": 192, "index_topk": 16},   # below the prompt: sparse
    "moonshotai/Moonlight-16B-A3B": {},
    # all three layer types (SWA, CSA, HCA) and hash layers; 8 heads for its 8 output groups. The indexer
    # keeps every entry: with bf16-rounded activations a near-tie in its top-k may flip between cached
    # decode and the full forward (the sparse selection is checked against transformers in fp32)
    "deepseek-ai/DeepSeek-V4-Flash": {"num_hidden_layers": 4, "num_attention_heads": 8, "sliding_window": 16,
                                      "compress_ratios": [0, 4, 128, 4, 0], "index_topk": 16},
}
SHRINK = {"num_hidden_layers": 2, "first_k_dense_replace": 1, "hidden_size": 256, "intermediate_size": 512,
          "moe_intermediate_size": 128, "n_routed_experts": 16, "num_attention_heads": 4,
          "num_key_value_heads": 4}
# SHRINK keys a family's config does not have (V4: no dense layers or dense MLP width; one KV head)
NOT_IN_CONFIG = {"deepseek-ai/DeepSeek-V4-Flash": ("first_k_dense_replace", "intermediate_size",
                                                   "num_key_value_heads")}


def default_overrides(model: str, extra: dict) -> dict:
    """The overrides of one default smoke run: SHRINK (less the keys its config lacks), the model's own
    entry, then the user's."""
    shrink = {k: v for k, v in SHRINK.items() if k not in NOT_IN_CONFIG.get(model, ())}
    return {**shrink, **DEFAULT_MODELS[model], **extra}


def decode_tolerance(eng) -> float:
    """How far cached decode may drift from the full forward, relative to max |logit|. Both sum the
    same products in a different order; with bf16 or FP8 weights the activations are rounded to bf16
    before each product (as transformers and llama.cpp do for bf16), so an fp32-sized difference can
    flip one rounding and show up at bf16's resolution (2^-8) in a few logits. A cache bug (a wrong
    position or a stale row) moves every logit by far more than either bound."""
    return 2.0 ** -6 if eng.bf16_activations else 1e-3


@dataclass
class SmokeResult:
    model: str
    family: str
    layers: int
    experts: int
    prefill_tps: float
    decode_tps: float
    max_decode_err: float     # |cached decode logits - full forward logits| / max |logit|
    status: str               # "ok" or what failed


def run(model: str, *, dummy_weights: bool, hf_overrides=None, seed: int = 0, threads: int | None = None,
        prompt_tokens: int = 32, decode_tokens: int = 16, dummy_dtype: str = "bf16") -> SmokeResult:
    import cpumla

    if prompt_tokens < 1 or decode_tokens < 1:
        raise CpumlaError("smoke needs at least one prompt token and one decode step")
    eng = cpumla.load(model, dummy_weights=dummy_weights, hf_overrides=hf_overrides, seed=seed, threads=threads,
                      max_seq_len=prompt_tokens + decode_tokens + 1, dummy_dtype=dummy_dtype)
    cfg = eng.config
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, cfg.vocab_size, size=prompt_tokens).tolist()
    t0 = time.perf_counter()
    logits = eng.forward(prompt, last_only=True)
    t_prefill = time.perf_counter() - t0
    steps, tokens, status = [], list(prompt), "ok"
    t0 = time.perf_counter()
    for _ in range(decode_tokens):
        if not np.isfinite(logits).all():
            status = f"non-finite logits after {len(tokens)} tokens"
            break
        tok = int(np.argmax(logits[-1]))
        tokens.append(tok)
        logits = eng.forward([tok], last_only=True)
        steps.append(logits[-1])
    t_decode = time.perf_counter() - t0
    err = float("nan")
    if status == "ok":
        eng.reset()
        full = eng.forward(tokens)[prompt_tokens:]
        inc = np.stack(steps)
        err = float(np.abs(full - inc).max() / max(np.abs(full).max(), 1e-30))
        if not np.isfinite(full).all():
            status = "non-finite logits in the full forward"
        elif err > decode_tolerance(eng):
            status = f"cached decode differs from the full forward ({err:.2g})"
    return SmokeResult(model, cfg.model_type, cfg.num_hidden_layers, cfg.n_routed_experts or 0,
                       prompt_tokens / t_prefill, len(steps) / t_decode if steps else 0.0, err, status)
