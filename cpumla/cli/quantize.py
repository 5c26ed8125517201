"""`cpumla quantize MODEL OUTDIR --quant q8|q4`: write a q8 / q4 checkpoint (runtime/quantize.py)."""

from __future__ import annotations

import typer

from cpumla.cli import render
from cpumla.cli.options import check_quant, check_threads, dummy_dtypes_help
from cpumla.errors import CpumlaError


def quantize(
    model: str = typer.Argument(..., help="Model dir, cached repo id, or preset (presets need --dummy-weights)."),
    outdir: str = typer.Argument(..., help="Directory to create with the quantized checkpoint."),
    quant: str = typer.Option(None, "--quant", help="q8 (8.5 bits a weight) or q4 (4.5)."),
    force: bool = typer.Option(False, "--force", metavar="", help="Replace OUTDIR if it exists."),
    dummy_weights: bool = typer.Option(False, "--dummy-weights", metavar="", help="Deterministic random weights."),
    hf_overrides: str = typer.Option(None, "--hf-overrides", help="JSON merged into the config (as vLLM)."),
    dummy_dtype: str = typer.Option("bf16", "--dummy-dtype", help=f"Dummy weight format: {dummy_dtypes_help()}."),
    seed: int = typer.Option(0, "--seed", help="Dummy weights' seed."),
    threads: int = typer.Option(None, "--threads", "-t"),
) -> None:
    from cpumla.cli.overrides import parse_hf_overrides
    from cpumla.runtime.quantize import quantize_checkpoint

    if quant is None:
        raise CpumlaError("--quant is required: q8 or q4")
    check_quant(quant)
    for w in check_threads(threads):
        render.err.print(f"note: {w}", style="yellow", markup=False, highlight=False)
    with render.loading(f"quantizing {model}", quant) as progress:
        s = quantize_checkpoint(model, outdir, quant, force=force, dummy_weights=dummy_weights,
                                hf_overrides=parse_hf_overrides(hf_overrides), seed=seed, dummy_dtype=dummy_dtype,
                                threads=threads, progress=progress)
    made = ", ".join(f"{n} {f}" for f, n in sorted(s["quantized"].items())) or "none"
    render.out.print(f"wrote {s['outdir']}: weights quantized {made}, {s['kept']} tensors kept as stored; "
                     f"{s['source_bytes'] / 1e9:.2f} GB -> {s['bytes'] / 1e9:.2f} GB", markup=False, highlight=False,
                     soft_wrap=True)
