"""`cpumla info`: what this machine is and what cpumla will run on it; `cpumla info MODEL`: what a model
takes (weights in each format, cache) and whether it fits this machine's memory, before loading it; the
decode speed to expect here (the weight bytes a token reads over a read-bandwidth probe taken then); and
when nothing fits, what would. For a GGUF model (a file, a folder holding one, a split set's shard, or
REPO:QUANT in the hub cache) also its tensor types and bytes by group, from the tensor index
(checkpoint/gguf_info.py)."""

from __future__ import annotations

import platform
from pathlib import Path

import typer

from cpumla import __version__, native
from cpumla.checkpoint.formats import QUANTS
from cpumla.errors import CpumlaError
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
    tp: int = typer.Option(None, "--tp", metavar="N", help="With MODEL: what each of N tensor-parallel ranks holds "
                           "and reads a decode token."),
    draft_model: str = typer.Option(None, "--draft-model", "-md", metavar="FILE", help="With a GGUF MODEL: its MTP "
                                    "file (llama.cpp's converter with --mtp) wherever it lies, shown and planned as "
                                    "its MTP layer. Default: the one beside the model."),
) -> None:
    if tp is not None and model is None:
        raise CpumlaError("--tp goes with a MODEL: what each rank of it holds")
    if draft_model is not None and model is None:
        raise CpumlaError("--draft-model goes with a MODEL: the GGUF model it drafts for")
    if model is not None:
        if threads is not None:
            from cpumla.cli.options import check_threads

            for w in check_threads(threads):
                render.err.print(f"note: {w}", style="yellow", markup=False, highlight=False)
            native.set_threads(threads)            # the read probe's threads, as decode would run
        from cpumla.runtime.resolve import resolve_model
        from cpumla.runtime.speculative import mtp_source

        mtp = None if draft_model is None else mtp_source("mtp", draft_model)
        if is_gguf(model):
            return gguf_plan(model, ctx, hf_overrides, json_out, tp, mtp)
        if mtp is not None:
            resolve_model(model, mtp)              # refuses: an MTP file drafts for a GGUF model only
        return model_plan(model, ctx, hf_overrides, json_out, tp)
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
    kernels = list(d["kernel_formats"])      # a row a format: the formats outnumber the kernels
    render.table("kernels by weight format", ["format", *kernels],
                 [[f, *(d["kernel_formats"][k][f] for k in kernels)] for f in native.DTYPES])
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


def gguf_plan(model: str, ctx: int | None, hf_overrides: str | None, json_out: bool, tp: int | None = None,
              mtp=None) -> None:
    """mtp: where the MTP layer comes from (runtime/speculative.py: mtp_source; None: the file beside)."""
    from cpumla.checkpoint.gguf_info import groups
    from cpumla.cli.options import check_ctx
    from cpumla.cli.overrides import parse_hf_overrides
    from cpumla.runtime.plan import plan
    from cpumla.runtime.resolve import load_config

    if ctx is not None:
        check_ctx(ctx, 1 << 62)
    cfg, resolved = load_config(model, parse_hf_overrides(hf_overrides), mtp=mtp)
    g = resolved.gguf
    try:
        side = g.side.entries if g.side is not None else None        # an MTP file: beside it, or -md's
        by_group = groups(g.file.entries, cfg.num_hidden_layers if cfg.num_nextn_predict_layers else None, side)
        files = [str(f) for f in g.file.files]
        mtp_file = str(g.side.files[0]) if g.side is not None else None
        p = plan(model, max_seq_len=ctx, loaded=(cfg, resolved, g))
    finally:
        g.close()
    total = {"tensors": sum(v["tensors"] for v in by_group.values()),
             "bytes": sum(v["bytes"] for v in by_group.values())}
    gbs = read_gbs()
    if json_out:
        render.print_json({**p.to_dict(), "decode_here": decode_here(p, gbs),
                           "gguf": {"files": files, "mtp_file": mtp_file, "groups": by_group, "total": total},
                           **({"per_rank": p.per_rank(tp)} if tp else {})})
        return
    gib = lambda b: f"{b / 2**30:.2f}"   # noqa: E731
    rows = [[name, v["tensors"], ", ".join(f"{t}: {c['tensors']}" for t, c in v["types"].items()),
             f"{v['bytes']:,}", gib(v["bytes"])] for name, v in by_group.items()]
    rows.append(["total", total["tensors"], "", f"{total['bytes']:,}", gib(total["bytes"])])
    render.out.print(f"file: {files[0]}" if len(files) == 1 else f"files: {files[0]} and {len(files) - 1} more shards",
                     markup=False, highlight=False, soft_wrap=True)
    if mtp_file is not None:
        render.out.print(f"MTP layer from: {mtp_file}", markup=False, highlight=False, soft_wrap=True)
    render.table("tensors by group", ["group", "tensors", "types", "bytes", "GiB"], rows, right={1, 3, 4})
    render.out.print()
    show_plan(p, gbs)
    show_ranks(p, tp)


def model_plan(model: str, ctx: int | None, hf_overrides: str | None, json_out: bool, tp: int | None = None) -> None:
    from cpumla.cli.options import check_ctx
    from cpumla.cli.overrides import parse_hf_overrides
    from cpumla.runtime.plan import plan

    if ctx is not None:
        check_ctx(ctx, 1 << 62)
    p = plan(model, parse_hf_overrides(hf_overrides), ctx)
    gbs = read_gbs()
    if json_out:
        render.print_json({**p.to_dict(), "decode_here": decode_here(p, gbs),
                           **({"per_rank": p.per_rank(tp)} if tp else {})})
        return
    show_plan(p, gbs)
    show_ranks(p, tp)


def show_ranks(p, tp: int | None) -> None:
    """--tp N: each rank's weights and decode-token bytes, per format (caches and scratch: as above)."""
    if not tp:
        return
    r = p.per_rank(tp)
    label = {"stored": p.stored, "bf16": "bf16", "q8": "--quant q8", "q4": "--quant q4"}
    render.out.print()
    render.table(f"each of {tp} tensor-parallel ranks (heads, experts' intermediate dimension and vocabulary split "
                 f"{tp} ways; the rest whole on every rank; caches and scratch as above, on every rank)",
                 ["format", "weights a rank", "of the whole", "read a decode token", "of the whole"],
                 [[label[f], f"{w / 2**30:.2f} GiB", f"{100 * w / max(p.weights[f], 1):.0f}%",
                   f"{megabytes(r['token_bytes'][f])} MB", f"{100 * r['token_bytes'][f] / max(p.token_bytes[f], 1):.0f}%"]
                  for f, w in r["weights"].items()], right={1, 2, 3, 4})


PROBE_BYTES = 512 << 20


def read_gbs() -> float:
    """GB/s of the read probe over a buffer of its own (512 MiB; less where less memory is free), taken
    now: what decode here is bound by (a tenth of a second or so)."""
    from cpumla.bench.model import BandwidthProbe
    from cpumla.runtime.memory import available_memory

    native.ensure_init()
    return BandwidthProbe(min_bytes=max(64 << 20, min(PROBE_BYTES, available_memory()[0] // 8)))()


def decode_here(p, gbs: float) -> dict:
    """The probe and, per weight format, the decode tokens a second it allows (were that format to fit)."""
    return {"read_probe_gbs": gbs, "tok_s": {f: p.decode_tok_s(f, gbs) for f in p.token_bytes}}


def show_plan(p, gbs: float) -> None:
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
    render.table("weights", ["format", "weights", "with cache and scratch", "fits", "decode here"],
                 [[label[f], gib(b), gib(p.need(f)), "yes" if p.fits(f) else "no",
                   f"{p.decode_tok_s(f, gbs):.1f} tok/s" if p.fits(f) else ""] for f, b in p.weights.items()],
                 right={1, 2, 4})
    runs = next((f for f in ("stored", *QUANTS) if f in p.weights and p.fits(f)), None)
    if runs is not None:
        render.print_line(f"decode here: about {p.decode_tok_s(runs, gbs):.1f} tok/s "
                          f"{label[runs].replace('--quant', 'with --quant')} ({megabytes(p.token_bytes[runs])} MB a "
                          f"token at {gbs:.1f} GB/s measured)")
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
        what = f"as {'stored' if p.stored == 'as stored' else 'released'} it does not fit"
        if q:
            render.print_line(f"{what}: --quant {q} would fit")
        else:
            render.print_line(f"{what}{', nor with --quant' if 'q4' in p.weights else ''}; what would:")
            for line in what_would_fit(p, s):
                render.print_line(f"  - {line}")


def what_would_fit(p, s: dict | None) -> list[str]:
    """When no format of the model fits: its routed experts read from disk (when the rest fits with a
    token's experts), a GGUF file small enough, and the largest smaller presets that fit."""
    from cpumla.runtime.memory import gib
    from cpumla.runtime.plan import plan
    from cpumla.runtime.resolve import PRESETS

    lines = []
    if s is not None and s["held"] * p.routed >= p.routed_per_token > 0:
        lines.append("this model with its routed experts read from disk as tokens use them (chat, serve, bench "
                     "and smoke do it by themselves; --memory SIZE sets the budget): see the line above")
    room = p.available - p.cache - p.scratch
    bits = 8 * room / p.params if p.params else 0.0
    types = sorted((8 * per / block, name) for name, (block, per) in native.GGUF_FORMATS.items())
    below = [t for t in types if t[0] <= bits]
    if below:
        lines.append(f"a GGUF file of this model of at most {gib(room)}: {bits:.2f} bits a weight on average "
                     f"({below[-1][1].upper()} takes {below[-1][0]:.2f}; `cpumla download REPO:QUANT` fetches one)")
    fitting = []
    for name in PRESETS:
        other = plan(name, max_seq_len=p.ctx, dummy=True)
        how = next((f for f in ("stored", *QUANTS) if f in other.weights and other.fits(f)), None)
        if how is not None and other.params < p.params:
            fitting.append((other.params, name, "as released" if how == "stored" else f"with --quant {how}"))
    groups: dict[tuple, list[str]] = {}                  # the two largest that fit, with those of their size
    for n, name, how in sorted(fitting, key=lambda f: (-f[0], f[1])):
        if (n, how) in groups or len(groups) < 2:
            groups.setdefault((n, how), []).append(name)
    if groups:
        lines.append("a smaller model: " + "; ".join(f"{', '.join(names)} ({n / 1e9:.1f} B parameters, {how})"
                                                     for (n, how), names in groups.items()))
    return lines or [f"no model cpumla knows of fits in {gib(p.available)}"]


def megabytes(b: float) -> str:
    """MB with at least three significant digits."""
    return f"{b / 1e6:.0f}" if b >= 1e8 else f"{b / 1e6:.3g}"
