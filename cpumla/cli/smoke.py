"""`cpumla smoke`: load a model (real or dummy weights), prefill, decode, and check that the logits are
finite and that cached decode matches one full forward over the same tokens; one table row per model."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

import numpy as np
import typer

from cpumla.cli import render
from cpumla.cli.options import (
    MEMORY_HELP,
    QUANT_HELP,
    TP_HELP,
    apply_tp,
    check_quant,
    check_threads,
    dummy_dtypes_help,
    parse_size,
)
from cpumla.cli.overrides import parse_hf_overrides
from cpumla.errors import CpumlaError
from cpumla.models import family
from cpumla.runtime.loader import load
from cpumla.runtime.resolve import load_config

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


def quantizable(model: str) -> bool:
    """Whether --quant covers this model's family (V4 not yet)."""
    return getattr(family(load_config(model)[0].model_type), "QUANTIZABLE", True)


def default_overrides(model: str, extra: dict, tp: int | None = None) -> dict:
    """The overrides of one default smoke run: SHRINK (less the keys its config lacks), the model's own
    entry, then the user's. Under --tp N every expert is N FP8 blocks (128 rows) wide, one a rank."""
    shrink = {k: v for k, v in SHRINK.items() if k not in NOT_IN_CONFIG.get(model, ())}
    if tp and tp > 1:
        shrink["moe_intermediate_size"] = 128 * tp
    return {**shrink, **DEFAULT_MODELS[model], **extra}


def decode_tolerance(eng) -> float:
    """How far cached decode may drift from the full forward, relative to max |logit|. Both sum the
    same products in a different order; with bf16 or FP8 weights the activations are rounded to bf16
    before each product (as transformers and llama.cpp do for bf16), with q8 / q4 weights to int8 per
    block of 32, so an fp32-sized difference can flip one rounding and show up at about that
    resolution (2^-8) in a few logits. A cache bug (a wrong
    position or a stale row) moves every logit by far more than either bound."""
    return 2.0 ** -6 if eng.rounded_activations else 1e-3


@dataclass
class SmokeResult:
    model: str
    family: str
    layers: int
    experts: int
    prefill_tps: float
    decode_tps: float
    max_decode_err: float     # |cached decode logits - full forward logits| / max |logit|
    status: str               # "ok", "ok: expert-routing near-tie ...", or what failed

    @property
    def passed(self) -> bool:
        return self.status == "ok" or self.status.startswith("ok:")


def run(model: str, *, dummy_weights: bool, hf_overrides=None, seed: int = 0, threads: int | None = None,
        prompt_tokens: int = 32, decode_tokens: int = 16, dummy_dtype: str = "bf16", quant: str | None = None,
        progress=None, memory: int | None = None) -> SmokeResult:
    if prompt_tokens < 1 or decode_tokens < 1:
        raise CpumlaError("smoke needs at least one prompt token and one decode step")
    eng = load(model, dummy_weights=dummy_weights, hf_overrides=hf_overrides, seed=seed, threads=threads,
                      max_seq_len=prompt_tokens + decode_tokens + 1, dummy_dtype=dummy_dtype, quant=quant,
                      progress=progress, memory=memory)
    try:
        return _check(eng, model, seed, prompt_tokens, decode_tokens,
                      dict(dummy_weights=dummy_weights, hf_overrides=hf_overrides, seed=seed, threads=threads,
                           max_seq_len=prompt_tokens + decode_tokens + 1, dummy_dtype=dummy_dtype, quant=quant,
                           memory=memory))
    finally:
        eng.close()          # its caches now, and tensor-parallel ranks before the next model starts its own


def _check(eng, model, seed, prompt_tokens, decode_tokens, load_kw) -> SmokeResult:
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
        per_step = _step_errors(full, inc)
        err = float(per_step.max())
        if not np.isfinite(full).all():
            status = "non-finite logits in the full forward"
        elif err > decode_tolerance(eng):
            bad = [i + 1 for i in np.flatnonzero(per_step > decode_tolerance(eng))]
            eng.close()
            status = _tie_or_bug(model, cfg, tokens, prompt_tokens, bad, err, load_kw)
    return SmokeResult(model, cfg.model_type, cfg.num_hidden_layers, cfg.n_routed_experts or 0,
                       prompt_tokens / t_prefill, len(steps) / t_decode if steps else 0.0, err, status)


def _step_errors(full: np.ndarray, inc: np.ndarray) -> np.ndarray:
    """Each decode step's max |difference| relative to the full forward's max |logit|."""
    return np.abs(full - inc).max(axis=1) / max(float(np.abs(full).max()), 1e-30)


def continuous_routing(cfg, ctx: int) -> dict:
    """hf_overrides that remove every discrete choice a token's forward makes in a context of ctx
    positions (expert top-k and group limits; V3.2's index top-k: ctx, every cached row) without
    touching a weight. The index top-k sizes the indexer's scratch, so it is ctx and no more."""
    ov = {}
    if getattr(cfg, "n_routed_experts", None):
        ov["num_experts_per_tok"] = cfg.n_routed_experts
        if hasattr(cfg, "n_group"):                 # V2 / V3's group limits (V4 has none)
            ov.update(n_group=1, topk_group=1)
    if getattr(cfg, "index_topk", None) is not None:
        ov["index_topk"] = max(int(ctx), cfg.index_topk)
    return ov


def _tie_or_bug(model, cfg, tokens, prompt_tokens, bad_steps, err, load_kw) -> str:
    """Why cached decode and the full forward disagree. They sum the same products in different
    orders; with bf16-rounded activations one rounding can flip an expert choice that was a near-tie,
    and that token's logits then move by far more than the tolerance. So the same weights and tokens
    are run again with every expert routed (and every index row kept): a near-tie has no choice left
    to flip and passes; a cache bug fails the same way."""
    what = f"cached decode differs from the full forward ({err:.2g} at step{'s' if len(bad_steps) > 1 else ''} " \
           f"{', '.join(map(str, bad_steps[:4]))}{', ...' if len(bad_steps) > 4 else ''})"
    ov = continuous_routing(cfg, load_kw["max_seq_len"])
    if not ov:
        return what
    kw = dict(load_kw)
    kw["hf_overrides"] = {**(kw.get("hf_overrides") or {}), **ov}
    eng = load(model, **kw)
    try:
        eng.forward(tokens[:prompt_tokens], last_only=True)
        inc = np.stack([eng.forward([t], last_only=True)[-1] for t in tokens[prompt_tokens:]])
        eng.reset()
        full = eng.forward(tokens)[prompt_tokens:]
        again = float(_step_errors(full, inc).max())
        tol = decode_tolerance(eng)
    finally:
        eng.close()
    if again <= tol:
        return f"ok: expert-routing near-tie ({what}; {again:.1g} with every expert routed)"
    return f"{what}; not a routing tie ({again:.2g} with every expert routed)"


def _family(model_type: str) -> str:
    """model_type without the "deepseek_" every family has: v2, v3, v32, v4."""
    return model_type[len("deepseek_"):] if model_type.startswith("deepseek_") else model_type


def show(results: list[SmokeResult]) -> None:
    """The table, narrow enough for 80 columns: model names whole, and a status that needs words (a
    near-tie, a failure) as a marker in its cell and a footnote under the table."""
    rows, notes = [], []
    for r in results:
        name, status = r.model.rstrip("/").split("/")[-1], r.status
        if status != "ok":
            notes.append(f"[{len(notes) + 1}] {name}: {status[len('ok: '):] if r.passed else status}")
            status = f"{'ok' if r.passed else 'FAILED'} [{len(notes)}]"
        rows.append([name, _family(r.family), r.layers, r.experts,
                     f"{r.prefill_tps:.1f}", f"{r.decode_tps:.1f}", f"{r.max_decode_err:.1e}", status])
    render.table(None, ["model", "family", "layers", "experts", "prefill tok/s", "decode tok/s", "decode vs full",
                        "status"], rows, right={2, 3, 4, 5, 6}, compact=True, keep={0, 2, 3, 4, 5, 6, 7})
    for n in notes:
        render.print_wrapped(n)


def smoke(
    model: str = typer.Option(None, "--model", "-m", help="Model dir, cached repo id or preset. Default: "
                              "shrunk V2-Lite, V2, V3, V3.2 and Moonlight configs (needs --dummy-weights)."),
    dummy_weights: bool = typer.Option(False, "--dummy-weights", metavar="", help="Deterministic random weights."),
    hf_overrides: str = typer.Option(None, "--hf-overrides", help="JSON merged into the config (as vLLM)."),
    dummy_dtype: str = typer.Option("bf16", "--dummy-dtype", help=f"Dummy weight format: {dummy_dtypes_help()} "
                                    f"(fp8: FP8 block-scaled linears)."),
    seed: int = typer.Option(0, "--seed", help="Dummy weights' seed, and the prompt's."),
    threads: int = typer.Option(None, "--threads", "-t", help="Threads (default: one per core)."),
    prompt_tokens: int = typer.Option(32, "--prompt-tokens", "-p", help="Random prompt tokens of each model."),
    decode_tokens: int = typer.Option(16, "--decode-tokens", "-n", help="Greedy decode steps, each checked against "
                                      "the full forward."),
    quant: str = typer.Option(None, "--quant", help=QUANT_HELP),
    memory: str = typer.Option(None, "--memory", metavar="SIZE", help=MEMORY_HELP),
    tp: int = typer.Option(None, "--tp", metavar="N", help=TP_HELP),
) -> None:
    check_quant(quant)
    apply_tp(tp)
    budget = parse_size(memory)
    if model is None and not dummy_weights:
        raise CpumlaError("without --model, smoke runs the bundled configs and needs --dummy-weights")
    for w in check_threads(threads):
        render.err.print(f"note: {w}", style="yellow", markup=False, highlight=False)
    extra = parse_hf_overrides(hf_overrides)      # each key is checked against each config on load
    if model is None:
        runs = [(m, default_overrides(m, extra, tp)) for m in DEFAULT_MODELS]
        if quant is not None:            # families --quant does not cover yet are left out, saying so
            kept = [r for r in runs if quantizable(r[0])]
            for m in sorted({r[0] for r in runs} - {r[0] for r in kept}):
                render.err.print(f"note: {m} left out: --quant is not supported for its family yet", style="yellow",
                                 markup=False, highlight=False)
            runs = kept
    else:
        runs = [(model, extra)]
    results = []
    with render.err.status("") as status:
        for m, ov in runs:
            status.update(f"smoke: {render.escape(m)}")

            def progress(done, total, m=m):
                status.update(f"smoke: {render.escape(m)}: quantizing to {quant}, {100 * done / max(total, 1):.0f}%")

            results.append(run(m, dummy_weights=dummy_weights, hf_overrides=ov, seed=seed, threads=threads,
                                  prompt_tokens=prompt_tokens, decode_tokens=decode_tokens,
                                  dummy_dtype=dummy_dtype, quant=quant, progress=progress, memory=budget))
    show(results)
    if not all(r.passed for r in results):
        sys.exit(1)
