"""`cpumla bench`: model benchmark (llama-bench style) or, with --kernels, the kernel micro-benchmark."""

from __future__ import annotations

import csv
import io
import json
import math
import time

import typer
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from cpumla import native
from cpumla.bench.peaks import tile_peaks as tile_peaks_of
from cpumla.cli import render
from cpumla.cli.options import (
    DRAFT_MODEL_HELP,
    DRAFT_TOKENS_HELP,
    MEMORY_HELP,
    QUANT_HELP,
    TP_HELP,
    apply_tp,
    check_draft,
    check_quant,
    check_threads,
    dummy_dtypes_help,
    parse_size,
)
from cpumla.cli.overrides import parse_hf_overrides
from cpumla.errors import CpumlaError

OUTPUTS = ("md", "json", "jsonl", "csv")


def _ints(text: str, flag: str) -> list[int]:
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise CpumlaError(f"{flag} takes comma-separated integers, got '{text}'") from None
    if not vals:
        raise CpumlaError(f"{flag} needs at least one value")
    return vals


def bench(
    model: str = typer.Argument(None, help="Model dir, cached repo id or preset (with --dummy-weights)."),
    kernels: bool = typer.Option(False, "--kernels", metavar="", help="Kernel micro-benchmark: GEMV GB/s per weight format "
                                 "vs a read-bandwidth probe, GEMM GFLOP/s vs the fp32 FMA probe."),
    dummy_weights: bool = typer.Option(False, "--dummy-weights", metavar="", help="Deterministic random weights."),
    hf_overrides: str = typer.Option(None, "--hf-overrides", help="JSON merged into the config (as vLLM)."),
    dummy_dtype: str = typer.Option("bf16", "--dummy-dtype", help=f"Dummy weight format: {dummy_dtypes_help()}."),
    n_prompt: int = typer.Option(512, "--n-prompt", "-p", help="Prompt tokens of the prefill test (0: none)."),
    n_gen: int = typer.Option(128, "--n-gen", "-n", help="Tokens of the decode test (0: none)."),
    reps: int = typer.Option(5, "--repetitions", "-r", help="Measured runs of each test (after a warm-up)."),
    threads: str = typer.Option(None, "--threads", "-t", help="Comma-separated thread counts (default: all cores)."),
    depths: str = typer.Option("0", "--n-depth", "-d", help="Comma-separated KV-cache depths."),
    output: str = typer.Option("md", "--output", "-o", help="md, json, jsonl or csv."),
    seed: int = typer.Option(0, "--seed", help="Dummy weights' seed, and the random tokens'."),
    quant: str = typer.Option(None, "--quant", help=QUANT_HELP),
    memory: str = typer.Option(None, "--memory", metavar="SIZE", help=MEMORY_HELP),
    draft: str = typer.Option(None, "--draft", metavar="mtp|ngram|none",
                              help="mtp or ngram: also time verifying 2 .. K+1 tokens against 1, and decode with "
                              "every draft kept (the pp / tg tests never draft)."),
    draft_tokens: int = typer.Option(1, "--draft-tokens", help=DRAFT_TOKENS_HELP),
    draft_model: str = typer.Option(None, "--draft-model", "-md", metavar="FILE", help=DRAFT_MODEL_HELP),
    formats: str = typer.Option(",".join(("f32", "bf16", "f16", "e4m3", "e4m3-e8m0", "e2m1", "q8", "q4")), "--formats",
                                help="--kernels: comma-separated GEMV weight formats (GGUF's too: q8_0, q4_k, q2_k, iq2_xxs, mxfp4, ...)."),
    report: bool = typer.Option(False, "--report", metavar="", help="--kernels: also `cpumla info --json`, every "
                                "level checked against the scalar spec on this machine and the GEMV weight operands "
                                "(one document to attach to a bug report; a wrong result ends it with an error line and exit status 2)."),
    codes: str = typer.Option("random", "--codes", help="--kernels: comma-separated code distributions of the FP8 / "
                              "FP4 weights: random, subnormal (only subnormal codes), zero."),
    rows: int = typer.Option(10944, "--rows", help="--kernels: GEMV rows (default: a V2-Lite dense layer)."),
    cols: int = typer.Option(2048, "--cols", help="--kernels: GEMV columns."),
    seconds: float = typer.Option(1.0, "--seconds", help="--kernels: minimum time per measurement."),
    stream_mb: int = typer.Option(512, "--stream-mb", help="--kernels: copies of each weight add up to this many "
                                  "MiB (keep it well above the last-level cache)."),
    tp: int = typer.Option(None, "--tp", metavar="N", help=TP_HELP),
) -> None:
    check_quant(quant)
    check_draft(draft, draft_tokens, draft_model)
    apply_tp(tp)
    budget = parse_size(memory)
    if output not in OUTPUTS:
        raise CpumlaError(f"unknown output format '{output}' (choose from: {', '.join(OUTPUTS)})")
    if kernels:
        if model is not None:
            raise CpumlaError(f"--kernels measures the kernels alone and takes no model ('{model}'); "
                              f"leave one of them out")
        if output in ("jsonl", "csv"):
            raise CpumlaError("--kernels prints md or json")
        if quant is not None:
            raise CpumlaError("--quant quantizes a model; --kernels measures q8 and q4 through --formats")
        if budget is not None:
            raise CpumlaError("--memory is a model's budget; --kernels loads none")
        thr = _ints(threads, "--threads")[0] if threads else None
        return _kernels(output, thr, formats, rows, cols, seconds, stream_mb, codes, report)
    if report:
        raise CpumlaError("--report goes with --kernels")
    if model is None:
        raise CpumlaError("name a model (or a preset with --dummy-weights), or pass --kernels")
    mode = draft or ("mtp" if draft_model else "none")      # bench drafts only when asked
    _model(model, dummy_weights, parse_hf_overrides(hf_overrides), dummy_dtype, n_prompt, n_gen, reps, threads,
           depths, output, seed, quant, budget, (mode, draft_tokens, draft_model))


def _model(model, dummy_weights, hf_overrides, dummy_dtype, n_prompt, n_gen, reps, threads, depths, output, seed,
           quant=None, memory=None, draft=("none", 1, None)):
    from cpumla.bench import model as mb
    from cpumla.runtime import tp as tp_mod
    from cpumla.runtime.loader import load

    native.init()
    world = tp_mod.launch_world()                   # the ranks: torchrun's, or --tp's
    if world == 1:
        world = tp_mod.default_tp(None) or 1
    thr = _ints(threads, "--threads") if threads else [native.get_threads() if world == 1 else
                                                       tp_mod.threads_per_rank(world)]
    if world > 1 and len(thr) != 1:
        raise CpumlaError("--tp takes one --threads count (each rank's)")
    check_threads(thr)        # the one rule of every command (bench.model warns about counts above the cores)
    dep = _ints(depths, "--n-depth")
    need = max(dep) + max(n_prompt, n_gen, 0, 34 * (draft[1] + 1)) + 1
    from cpumla.runtime.resolve import load_config
    from cpumla.runtime.speculative import mtp_source
    cfg, resolved = load_config(model, hf_overrides, mtp=mtp_source(draft[0], draft[2]))
    for w in mb.check_args(cfg.max_position_embeddings, n_prompt, n_gen, reps, thr, dep):
        render.print_warning(w)
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                  console=render.err, transient=True) as prog:
        # the machine's limits first, so the probe's buffer is gone before the model is in memory
        task = prog.add_task("measuring FMA peak", total=None)
        peaks, bf16_peaks, tile_peaks = {}, {}, {}
        for t in thr:
            native.set_threads(t)
            prog.update(task, description=f"measuring FMA peaks, {t} threads")
            peaks[t] = mb.fma_peak_gflops()
            bf16_peaks[t] = mb.fma_peak_gflops(kind="bf16")
            tile_peaks[t] = tile_peaks_of()
        prog.update(task, description=f"loading {render.escape(model)}")
        t0 = time.perf_counter()
        eng = load(model, dummy_weights=dummy_weights, hf_overrides=hf_overrides, seed=seed,
                          max_seq_len=need, dummy_dtype=dummy_dtype, quant=quant, resolved=resolved, memory=memory,
                          draft=draft[0], draft_tokens=draft[1], draft_model=draft[2],
                          threads=thr[0] if world > 1 else None,
                          progress=lambda done, total: prog.update(task, description=f"quantizing to {quant}",
                                                                   completed=done, total=total))
        load_s = time.perf_counter() - t0
        probe = mb.BandwidthProbe(eng.model.probe_arrays())
        results = []
        for r in mb.run(eng, model_name=model, n_prompt=n_prompt, n_gen=n_gen, reps=reps, threads=thr, depths=dep,
                        load_s=load_s, probe=probe, peak_gflops=peaks, bf16_peak_gflops=bf16_peaks, seed=seed,
                        tile_peak_gflops=tile_peaks,
                        progress=lambda label, done, total: prog.update(task, description=render.escape(label), completed=done,
                                                                         total=total)):
            results.append(r)
        spec = []
        if eng.drafter is not None:
            import numpy as np

            from cpumla.bench import speculative as sb

            prog.update(task, description=f"speculative decoding ({eng.draft}, K={eng.draft_tokens})", total=None)
            spec = list(sb.run(eng, mb.AtDepth(eng, max(dep), np.random.default_rng([seed, 2])), thr, dep, reps,
                               eng.draft_tokens, np.random.default_rng([seed, 3])))
        tp = None
        if eng.ranks is not None:
            import numpy as np

            from cpumla.bench import tp as tpb

            prog.update(task, description=f"tensor parallel: {eng.ranks.world} ranks' exchanges", total=None)
            tp = tpb.run(eng, mb.AtDepth(eng, 0, np.random.default_rng([seed, 4])), thr[0],
                         rng=np.random.default_rng([seed, 5]))
    _print(results, output, eng, peaks, bf16_peaks, tile_peaks, spec, tp)


def _print(results, output, eng, peaks, bf16_peaks, tile_peaks, spec=(), tp=None):
    from cpumla.bench import model as mb
    from cpumla.bench import speculative as sb
    from cpumla.bench import tp as tpb

    dicts = [mb.as_dict(r) for r in results] + [{"model_type": eng.config.model_type, "draft": eng.draft,
                                                 **sb.as_dict(r)} for r in spec]
    if tp is not None:
        dicts.append({"model_type": eng.config.model_type, **tpb.as_dict(tp)})
    if output == "json":
        render.print_json(dicts)
        return
    if output == "jsonl":
        for d in dicts:
            render.out.print(json.dumps(d), soft_wrap=True, markup=False)
        return
    if output == "csv":
        buf = io.StringIO()
        keys = [k for k in dicts[0] if not k.startswith("samples")]
        wr = csv.DictWriter(buf, fieldnames=keys, extrasaction="ignore")
        wr.writeheader()
        wr.writerows(dicts)
        render.out.print(buf.getvalue().rstrip("\n"), soft_wrap=True, markup=False)
        return
    cfg = eng.config
    r0 = results[0]
    from cpumla.models import family

    params = sum(math.prod(shape) for shape, _ in family(cfg.model_type).tensors(cfg).values())
    render.print_line(f"model: {r0.model_filename} ({cfg.model_type}, {cfg.num_hidden_layers} layers, "
                      f"{params / 1e9:.2f} B parameters, {eng.matmul_format} linear layers, "
                      f"{eng.model.decode_bytes(0) / 1e6:.0f} MB read a decode token); implementation {r0.isa}; "
                      f"load {r0.load_s:.1f} s; peak RSS {max(r.peak_rss_mb for r in results):.0f} MB")
    from cpumla.bench.peaks import dot_name

    dot = dot_name()                       # None: the bf16 probe is the fp32 FMA loop on this level
    render.print_line("peaks: " + ", ".join(f"fp32 FMA {v:.0f}" + (f" / {dot} {bf16_peaks[t]:.0f}" if dot else "")
                                             + "".join(f" / {name} {g:.0f}" for name, g in tile_peaks[t].items())
                                             + f" GFLOP/s at {t} threads" for t, v in peaks.items())
                      + "; read bandwidth probed before and after each test")
    rows = []
    for r in results:
        # prefill against the peak that bounds its products, or none (bench/peaks.py)
        peak = (f"{r.pct_peak:.0f}% of the {r.peak} peak" if r.pct_peak is not None else
                f"no measured peak bounds its {r.no_peak}")
        extra = (f"{r.gbs:.1f} GB/s = {r.pct_bandwidth:.0f}% of {r.read_probe_gbs:.1f} GB/s probe" if r.n_gen else
                 f"{r.gflops:.0f} GFLOP/s = {peak}, TTFT {r.ttft_ms:.0f} ms" if r.pct_peak is not None else
                 f"{r.gflops:.0f} GFLOP/s ({peak}), TTFT {r.ttft_ms:.0f} ms")
        if r.expert_hit_rate is not None:
            extra += (f"; experts {100 * r.expert_hit_rate:.0f}% in memory, {r.disk_bytes_per_token / 1e6:.1f} MB a "
                      f"token from disk at {r.disk_read_gbps:.2f} GB/s = "
                      f"{100 * r.disk_read_gbps / max(r.disk_probe_gbps, 1e-9):.0f}% of {r.disk_probe_gbps:.2f} GB/s probe")
        rows.append([r.test, str(r.n_threads), f"{r.avg_ts:.2f} ± {r.stddev_ts:.2f}", extra])
    if eng.stream is not None:
        st = eng.stream.stats()
        render.print_line(f"routed experts from disk: {st.slots} slots of {st.slot_bytes / 2**20:.1f} MiB "
                          f"({st.slots * st.slot_bytes / 2**30:.1f} GiB), {eng.stream.policy}, "
                          f"{'direct I/O' if st.direct else 'buffered reads'}")
    render.table(None, ["test", "threads", "t/s", "vs the machine"], rows, right={1, 2})
    if tp is not None:
        render.print_line(tpb.line(tp))
    if spec:
        render.print_line(f"speculative decoding, {eng.draft} drafts: a forward of n tokens against one (bytes: "
                          "dense weights once, the union of the routed experts), and decode with every draft kept")
        render.table(None, ["test", "threads", "depth", "time", "measured", "by the bytes"],
                     sb.rows(spec, eng.draft), right={1, 2, 3})


def _kernels(output, threads, formats, rows, cols, seconds, stream_mb, codes="random", report=False):
    from cpumla.bench import kernels as kb

    fmts = [f.strip() for f in formats.split(",") if f.strip()]
    bad = [f for f in fmts if f not in kb.ALL_FORMATS]
    if bad:
        raise CpumlaError(f"unknown weight format '{bad[0]}' (choose from: {', '.join(kb.ALL_FORMATS)})")
    dists = [c.strip() for c in codes.split(",") if c.strip()]
    bad = [c for c in dists if c not in kb.CODES] or ([] if dists else [codes])
    if bad:
        raise CpumlaError(f"unknown code distribution '{bad[0]}' for --codes (choose from: {', '.join(kb.CODES)})")
    if rows < 1 or cols < 32 or cols % 32:
        raise CpumlaError("--rows must be >= 1 and --cols a positive multiple of 32")
    block = max((native.GGUF_FORMATS[f][0] for f in fmts if f in native.GGUF_FORMATS), default=32)
    if cols % block:
        raise CpumlaError(f"--cols {cols}: the GGUF formats asked for take a multiple of {block} columns")
    from cpumla.runtime.memory import available_memory, gib

    stream = max(1, stream_mb) << 20
    need = 5 * stream + 2 * 4 * rows * cols + 4 * 4 * 2048 * 2048   # probe buffers, weight copies, gemm
    avail, what = available_memory()
    if need > avail:
        raise CpumlaError(f"--rows {rows} --cols {cols} --stream-mb {stream_mb} need {gib(need)} of memory but "
                          f"{gib(avail)} is available ({what})")
    native.init()
    for w in check_threads(threads):
        render.print_warning(w)
    if threads is not None:
        native.set_threads(threads)
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                  console=render.err, transient=True) as prog:
        task = prog.add_task("starting", total=None)
        probe, results = kb.run(fmts, rows, cols, min_seconds=seconds, stream_bytes=stream, codes=dists,
                                progress=lambda label: prog.update(task, description=f"measuring {label}"))
    checked = _report(output) if report else None
    if output == "json":
        doc = {"read_probe_gbs": probe, "threads": native.get_threads(), "isa": native.isa(),
               "results": kb.as_dicts(results)}
        if checked:
            doc.update(checked)
        render.print_json(doc)
        _report_verdict(checked)
        return
    fma = max((r.fma_peak_gflops for r in results), default=0.0)
    measured = {r.peak: r.peak_gflops for r in results if r.peak}
    render.out.print(f"read bandwidth probe: [bold]{probe:.1f} GB/s[/] at the start, and around each GEMV"
                     + (f", fp32 FMA probe: [bold]{fma:.0f} GFLOP/s[/]" if fma else "")
                     + "".join(f", {name} probe: [bold]{v:.0f} GFLOP/s[/]" for name, v in measured.items()
                               if name != "fp32 FMA")
                     + f" ({native.get_threads()} threads, implementation {native.isa()})")
    rows_out = []
    for r in results:
        gemv = r.kernel == "gemv"
        rows_out.append([r.kernel, r.format, r.codes, r.shape, r.isa, f"{r.seconds * 1e6:.0f}",
                         f"{r.gbs:.1f}" if gemv else "", f"{r.pct_probe:.0f}% of {r.probe_gbs:.1f}" if gemv else "",
                         f"{r.cache_gbs:.1f}" if gemv else "", f"{r.gflops:.1f}",
                         "" if gemv else f"{r.pct_peak:.0f}% of {r.peak}" if r.pct_peak is not None else
                         f"none: {r.no_peak}"])
    render.table(None, ["kernel", "weights", "codes", "shape", "impl", "us/call", "GB/s", "% of probe",
                        "in cache GB/s", "GFLOP/s", "% of peak"], rows_out, right={5, 6, 7, 8, 9, 10})
    if any(r.kernel == "gemv" for r in results):
        render.out.print("in cache GB/s: the GEMV over weights that stay in cache, the most its instructions "
                         "read per second; below the probe, decode of that format is bound by the core")
    if any(r.kernel == "gemm" for r in results):
        render.out.print("% of peak: of the probe that bounds the GEMM's arithmetic (fp32 FMAs, or bf16 dot "
                         "products where the level has them); none for AMX tiles and int8 dot products, which "
                         "no probe bounds")
    if checked:
        render.out.print()
        render.out.print("cpumla info --json:")
        render.print_json(checked["info"])
        render.table("GEMV weight operands (a subnormal one costs a microcode assist on Intel cores)",
                     ["level", "format", "subnormal operands", "wrong values"],
                     [[o["isa"], o["format"], str(o["subnormal_operands"]), str(o["wrong_values"])]
                      for o in checked["operands"]])
        render.table("every level against the scalar spec on this machine (worst: error / fp32 bound)",
                     ["level", "kernel", "weights", "codes", "served by", "worst", ""],
                     [[c["isa"], c["kernel"], c["format"], c["codes"], c["impl"], f"{c['worst']:.3g}",
                       "ok" if c["ok"] else "WRONG"] for c in checked["checks"]])
    _report_verdict(checked)


def _report(output):
    from cpumla.bench import report as kr
    from cpumla.cli.info import collect

    return {"info": collect(), "operands": kr.operands(), "checks": kr.as_dicts(kr.checks())}


def _report_verdict(checked):
    if not checked:
        return
    bad = [c for c in checked["checks"] if not c["ok"]]
    bad_ops = [o for o in checked["operands"] if o["subnormal_operands"] or o["wrong_values"]]
    if bad or bad_ops:
        what = [f"{c['isa']} {c['kernel']} {c['format']} {c['codes']}".strip() for c in bad]
        what += [f"{o['isa']} {o['format']} operands" for o in bad_ops]
        raise CpumlaError(f"{len(what)} wrong: {', '.join(what[:6])}{' ...' if len(what) > 6 else ''}")
