"""`cpumla info`: what this machine is and what cpumla will run on it."""

from __future__ import annotations

import platform

import typer

from cpumla import __version__, native
from cpumla.cli import render


def isa_missing(isa: str) -> str | None:
    """What this CPU or OS lacks to run an implementation ("" when it runs here; None: not built)."""
    p = native.lib.cpumla_isa_missing(isa.encode())
    return None if p == native.ffi.NULL else native.ffi.string(p).decode()


def collect(threads: int | None = None) -> dict:
    from cpumla.cli.options import check_threads

    warnings = check_threads(threads)
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
        "implementations_missing": {i: isa_missing(i) for i in native.built_isas() if isa_missing(i)},
        "implementation": isa,
        "kernels": {k: native.kernel_impl(k) for k in native.KERNELS},
        "kernel_formats": native.kernel_formats(),
        "threads": native.get_threads(),
        "build": native.build_info().splitlines(),
        "warnings": warnings,
    }


def info(
    json_out: bool = typer.Option(False, "--json", metavar="", help="Print JSON instead of tables."),
    threads: int = typer.Option(None, "--threads", "-t", help="Threads (default: one per core)."),
) -> None:
    d = collect(threads)
    for w in d["warnings"]:
        render.err.print(f"note: {w}", style="yellow", markup=False, highlight=False)
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
        *[[f"not {k}", f"needs {v}"] for k, v in d["implementations_missing"].items()],
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
