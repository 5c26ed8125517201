"""`cpumla info`: what this machine is and what cpumla will run on it."""

from __future__ import annotations

import platform

import typer

from cpumla import __version__, native
from cpumla.cli import render


def collect(threads: int | None = None) -> dict:
    isa = native.init()           # honours CPUMLA_ISA; a CPU that lacks it is a CpumlaError
    if threads is not None:
        native.set_threads(threads)
    feats = native.cpu_features()
    return {
        "version": __version__,
        "machine": platform.machine(),
        "cpu": native.cpu_name(),
        "features": sorted(k for k, v in feats.items() if v and not k.startswith("os_")),
        "os_support": {k[3:]: v for k, v in feats.items() if k.startswith("os_")},
        "implementations_built": native.built_isas(),
        "implementations_available": native.available_isas(),
        "implementation": isa,
        "kernels": {k: native.kernel_impl(k) for k in native.KERNELS},
        "kernel_formats": native.kernel_formats(),
        "threads": native.get_threads(),
        "build": native.build_info().splitlines(),
    }


def info(
    json_out: bool = typer.Option(False, "--json", help="Print JSON instead of tables."),
    threads: int = typer.Option(None, "--threads", "-t", help="Threads (default: one per core)."),
) -> None:
    d = collect(threads)
    if json_out:
        render.print_json(d)
        return
    rows = [
        ["cpumla", d["version"]],
        ["cpu", f"{d['cpu']} ({d['machine']})"],
        ["features", " ".join(d["features"]) or "(none detected)"],
        ["os support", " ".join(f"{k}={'yes' if v else 'no'}" for k, v in d["os_support"].items())],
        ["built", " ".join(d["implementations_built"])],
        ["runnable here", " ".join(d["implementations_available"])],
        ["implementation", d["implementation"]],
        ["threads", str(d["threads"])],
    ]
    render.table(None, ["", ""], rows, header=False)
    render.out.print()
    render.table("kernels", ["kernel", "implementation"], [[k, v] for k, v in d["kernels"].items()])
    render.out.print()
    fmts = list(native.DTYPES)
    render.table("kernels by weight format", ["kernel", *fmts],
                 [[k, *(v[f] for f in fmts)] for k, v in d["kernel_formats"].items()])
    render.out.print()
    render.table("build", ["", ""], [line.split(": ", 1) for line in d["build"]], header=False)
