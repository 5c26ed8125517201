"""`cpumla info`: what this machine is and what cpumla will run on it; `cpumla info MODEL`: what a model
takes (weights in each format, cache) and whether it fits this machine's memory, before loading it. For a
GGUF model (a file, a folder holding one, a split set's shard, or REPO:QUANT in the hub cache) also its
tensor types and bytes by group, from the tensor index (checkpoint/gguf_info.py)."""

from __future__ import annotations

import platform
from pathlib import Path

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
        "gemv_prefetch": native.gemv_prefetch(),
        "build": native.build_info().splitlines(),
        "warnings": warnings,
    }


def info(
    model: str = typer.Argument(None, help="A model (directory, .gguf file, cached repo id or REPO:QUANT, or "
                                           "preset): what it takes."),
    json_out: bool = typer.Option(False, "--json", metavar="", help="Print JSON instead of tables."),
    threads: int = typer.Option(None, "--threads", "-t", help="Threads (default: one per core)."),
    ctx: int = typer.Option(None, "--ctx", help="With MODEL: the context to plan the cache for."),
    hf_overrides: str = typer.Option(None, "--hf-overrides", help="With MODEL: JSON merged into its config."),
) -> None:
    if model is not None:
        if is_gguf(model):
            return gguf_plan(model, ctx, hf_overrides, json_out)
        return model_plan(model, ctx, hf_overrides, json_out)
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
        ["gemv prefetch", d["gemv_prefetch"]],
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


def is_gguf(model: str) -> bool:
    """Whether `model` names a GGUF model: a .gguf file, a folder with one and no config.json, or REPO:QUANT."""
    from cpumla.runtime.gguf_hub import is_ref

    path = Path(model).expanduser()
    if path.is_file():
        return path.suffix == ".gguf"
    if path.is_dir():
        return not (path / "config.json").is_file() and any(path.glob("*.gguf"))
    return is_ref(model)


def gguf_plan(model: str, ctx: int | None, hf_overrides: str | None, json_out: bool) -> None:
    from cpumla.checkpoint.gguf_info import IndexOnly, groups
    from cpumla.cli.options import check_ctx
    from cpumla.cli.overrides import parse_hf_overrides
    from cpumla.runtime.plan import plan
    from cpumla.runtime.resolve import load_config

    if ctx is not None:
        check_ctx(ctx, 1 << 62)
    cfg, resolved = load_config(model, parse_hf_overrides(hf_overrides))
    g = resolved.gguf
    try:
        by_group = groups(g.file.entries)
        files = [str(f) for f in g.file.files]
        p = plan(model, max_seq_len=ctx, loaded=(cfg, resolved, IndexOnly(g)))
    finally:
        g.close()
    total = {"tensors": sum(v["tensors"] for v in by_group.values()),
             "bytes": sum(v["bytes"] for v in by_group.values())}
    if json_out:
        render.print_json({**p.to_dict(), "gguf": {"files": files, "groups": by_group, "total": total}})
        return
    gib = lambda b: f"{b / 2**30:.2f}"   # noqa: E731
    rows = [[name, v["tensors"], ", ".join(f"{t}: {c['tensors']}" for t, c in v["types"].items()),
             f"{v['bytes']:,}", gib(v["bytes"])] for name, v in by_group.items()]
    rows.append(["total", total["tensors"], "", f"{total['bytes']:,}", gib(total["bytes"])])
    render.out.print(f"file: {files[0]}" if len(files) == 1 else f"files: {files[0]} and {len(files) - 1} more shards",
                     markup=False, highlight=False, soft_wrap=True)
    render.table("tensors by group", ["group", "tensors", "types", "bytes", "GiB"], rows, right={1, 3, 4})
    render.out.print()
    show_plan(p)


def model_plan(model: str, ctx: int | None, hf_overrides: str | None, json_out: bool) -> None:
    from cpumla.cli.options import check_ctx
    from cpumla.cli.overrides import parse_hf_overrides
    from cpumla.runtime.plan import plan

    if ctx is not None:
        check_ctx(ctx, 1 << 62)
    p = plan(model, parse_hf_overrides(hf_overrides), ctx)
    if json_out:
        render.print_json(p.to_dict())
        return
    show_plan(p)


def show_plan(p) -> None:
    gib = lambda b: f"{b / 2**30:.2f} GiB"   # noqa: E731
    label = {"stored": p.stored, "bf16": "bf16", "q8": "--quant q8", "q4": "--quant q4"}
    render.table(None, ["", ""], [
        ["model", f"{p.model} ({p.model_type}, {p.where})"],
        ["parameters", f"{p.params / 1e9:.2f} B"],
        ["cache", f"{gib(p.cache_per_1k)} per 1k tokens; {gib(p.cache)} at {p.ctx} tokens (--ctx)"],
        ["scratch", gib(p.scratch)],
        ["available", f"{gib(p.available)} ({p.available_from})"],
    ], header=False)
    render.out.print()
    render.table("weights", ["format", "weights", "with cache and scratch", "fits"],
                 [[label[f], gib(b), gib(p.need(f)), "yes" if p.fits(f) else "no"] for f, b in p.weights.items()],
                 right={1, 2})
    for n in p.notes:
        render.out.print(f"note: {n}", markup=False, highlight=False)
    s = p.streamed()
    if s is not None:
        speed = (f"; at the {s['disk_probe_gbps']:.2f} GB/s this disk reads directly, decode up to "
                 f"{s['tok_s_bound']:.1f} tok/s" if s["tok_s_bound"] else "")
        render.out.print(f"routed experts from disk: {gib(p.routed)} of experts ({p.routed_per_token / 1e6:.0f} MB a "
                         f"token) beside {gib(s['resident'])} resident; the rest of the memory holds "
                         f"{100 * s['held']:.0f}% of them, so a token reads about "
                         f"{s['disk_bytes_per_token'] / 1e6:.0f} MB from disk (uniform routing){speed}",
                         markup=False, highlight=False, soft_wrap=True)
    if not p.fits("stored"):
        q = p.smallest_fitting_quant()
        streams = s is not None and s["held"] > 0
        render.out.print(f"as {'stored' if p.stored == 'as stored' else 'released'} it does not fit: "
                         + (f"--quant {q} would fit" if q else "its routed experts are read from disk as tokens use "
                            "them" if streams else "no --quant makes it fit here"), markup=False, highlight=False)
