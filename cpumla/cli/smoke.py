"""`cpumla smoke`: end-to-end runs with checks, one table row per model."""

from __future__ import annotations

import sys

import typer

from cpumla.cli import render
from cpumla.cli.options import QUANT_HELP, check_threads, dummy_dtypes_help
from cpumla.errors import CpumlaError


def smoke(
    model: str = typer.Option(None, "--model", "-m", help="Model dir, cached repo id or preset. Default: "
                              "shrunk V2-Lite, V2, V3, V3.2 and Moonlight configs (needs --dummy-weights)."),
    dummy_weights: bool = typer.Option(False, "--dummy-weights", metavar="", help="Deterministic random weights."),
    hf_overrides: str = typer.Option(None, "--hf-overrides", help="JSON merged into the config (as vLLM)."),
    dummy_dtype: str = typer.Option("bf16", "--dummy-dtype", help=f"Dummy weight format: {dummy_dtypes_help()} "
                                    f"(fp8: FP8 block-scaled linears)."),
    seed: int = typer.Option(0, "--seed"),
    threads: int = typer.Option(None, "--threads", "-t"),
    prompt_tokens: int = typer.Option(32, "--prompt-tokens", "-p"),
    decode_tokens: int = typer.Option(16, "--decode-tokens", "-n"),
    quant: str = typer.Option(None, "--quant", help=QUANT_HELP),
) -> None:
    from cpumla.cli.options import check_quant
    from cpumla.cli.overrides import parse_hf_overrides
    from cpumla.runtime import smoke as sm

    check_quant(quant)
    if model is None and not dummy_weights:
        raise CpumlaError("without --model, smoke runs the bundled configs and needs --dummy-weights")
    for w in check_threads(threads):
        render.err.print(f"note: {w}", style="yellow", markup=False, highlight=False)
    extra = parse_hf_overrides(hf_overrides)      # each key is checked against each config on load
    if model is None:
        runs = [(m, sm.default_overrides(m, extra)) for m in sm.DEFAULT_MODELS]
        if quant is not None:            # families --quant does not cover yet are left out, saying so
            kept = [r for r in runs if sm.quantizable(r[0])]
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

            results.append(sm.run(m, dummy_weights=dummy_weights, hf_overrides=ov, seed=seed, threads=threads,
                                  prompt_tokens=prompt_tokens, decode_tokens=decode_tokens,
                                  dummy_dtype=dummy_dtype, quant=quant, progress=progress))
    rows = [[r.model.rstrip("/").split("/")[-1], r.family, r.layers, r.experts, f"{r.prefill_tps:.1f}", f"{r.decode_tps:.1f}",
             f"{r.max_decode_err:.1e}", r.status] for r in results]
    render.table(None, ["model", "family", "layers", "experts", "prefill tok/s", "decode tok/s",
                        "decode vs full", "status"], rows, right={2, 3, 4, 5, 6})
    if not all(r.passed for r in results):
        sys.exit(1)
