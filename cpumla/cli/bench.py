"""`cpumla bench`: benchmarks. For now the kernel micro-benchmark (--kernels)."""

from __future__ import annotations

import typer
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from cpumla import native
from cpumla.cli import render
from cpumla.errors import CpumlaError

OUTPUTS = ("md", "json")


def bench(
    kernels: bool = typer.Option(False, "--kernels", help="GEMV GB/s per weight format vs a read-bandwidth probe."),
    output: str = typer.Option("md", "--output", "-o", help="md (table) or json."),
    threads: int = typer.Option(None, "--threads", "-t", help="Threads (default: one per core)."),
    formats: str = typer.Option(",".join(("f32", "bf16", "f16", "e4m3", "e4m3-e8m0", "e2m1")), "--formats",
                                help="Comma-separated GEMV weight formats."),
    rows: int = typer.Option(10944, "--rows", help="GEMV weight rows (default: a V2-Lite dense layer)."),
    cols: int = typer.Option(2048, "--cols", help="GEMV weight columns."),
    seconds: float = typer.Option(1.0, "--seconds", help="Minimum time per measurement."),
    stream_mb: int = typer.Option(512, "--stream-mb", help="Copies of each weight add up to this many MiB "
                                  "(keep it well above the last-level cache)."),
) -> None:
    from cpumla.native import bench as kb

    if output not in OUTPUTS:
        raise CpumlaError(f"unknown output format '{output}' (choose from: {', '.join(OUTPUTS)})")
    if not kernels:
        raise CpumlaError("model benchmarks come with the runtime; use `cpumla bench --kernels` for now")
    fmts = [f.strip() for f in formats.split(",") if f.strip()]
    bad = [f for f in fmts if f not in kb.FORMATS]
    if bad:
        raise CpumlaError(f"unknown weight format '{bad[0]}' (choose from: {', '.join(kb.FORMATS)})")
    if rows < 1 or cols < 32 or cols % 32:
        raise CpumlaError("--rows must be >= 1 and --cols a positive multiple of 32")
    native.init()
    if threads is not None:
        if threads < 1:
            raise CpumlaError("--threads must be >= 1")
        native.set_threads(threads)
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                  console=render.err, transient=True) as prog:
        task = prog.add_task("starting", total=None)
        probe, results = kb.run(fmts, rows, cols, min_seconds=seconds, stream_bytes=max(1, stream_mb) << 20,
                                progress=lambda label: prog.update(task, description=f"measuring {label}"))
    if output == "json":
        render.print_json({"read_probe_gbs": probe, "threads": native.get_threads(),
                           "isa": native.isa(), "results": kb.as_dicts(results)})
        return
    render.out.print(f"read bandwidth probe: [bold]{probe:.1f} GB/s[/] ({native.get_threads()} threads, "
                     f"implementation {native.isa()})")
    rows_out = []
    for r in results:
        if r.kernel == "gemv":
            rows_out.append([r.kernel, r.format, r.shape, r.isa, f"{r.seconds * 1e6:.0f}", f"{r.gbs:.1f}",
                             f"{r.pct_probe:.0f}%", f"{r.gflops:.1f}"])
        else:
            rows_out.append([r.kernel, r.format, r.shape, r.isa, f"{r.seconds * 1e6:.0f}", "", "",
                             f"{r.gflops:.1f}"])
    render.table(None, ["kernel", "weights", "shape", "impl", "us/call", "GB/s", "% of probe", "GFLOP/s"],
                 rows_out, right={4, 5, 6, 7})
