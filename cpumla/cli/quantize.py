"""`cpumla quantize MODEL OUTDIR --quant q8|q4`: a checkpoint whose linear layers are cpumla's q8 / q4
(cpumla.h), written as safetensors that load zero-copy like any other checkpoint.

What is written: every tensor the model reads (the family's tensors(); tensors it never reads, such as
V3's MTP layer, are left out), the linear weights chosen by checkpoint.quant.quant_plan as I8 (q8) or U8
(q4, two codes a byte) with an F16 scale grid named `<weight>_qscale`, the others as stored (FP8 ones with
their `weight_scale_inv`); config.json with a `quantization_config` naming the format and its version;
the source directory's other files (tokenizer, generation config) copied. The folder is written as
checkpoint/output.py says (beside OUTDIR, renamed into place once complete, `--force` replacing only
what cpumla wrote); the source is only read.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import typer

from cpumla import native
from cpumla.checkpoint.dummy import DummySource
from cpumla.checkpoint.output import check_target, staged_folder
from cpumla.checkpoint.formats import Q_DTYPE, QSCALE, QUANT_VERSION, QUANTS, quantized_as
from cpumla.checkpoint.quant import Quantizer, quant_plan
from cpumla.checkpoint.safetensors import INDEX_NAME, Checkpoint, nbytes, write_file
from cpumla.checkpoint.tensors import stored_linear, where
from cpumla.cli import render
from cpumla.cli.options import check_quant, check_threads, dummy_dtypes_help
from cpumla.cli.overrides import parse_hf_overrides
from cpumla.errors import CpumlaError
from cpumla.models import family
from cpumla.runtime.resolve import load_config

SHARD_BYTES = 4 << 30          # a new shard file once one reaches this many bytes
SKIP_FILES = {"config.json", "model.safetensors.index.json"}


def plan(cfg, fam, src, fmt: str):
    """[(group of entries written together)], entries (name, dtype, shape, get, elements to quantize)."""
    qz = Quantizer(fmt)
    groups = []
    tied = getattr(cfg, "tie_word_embeddings", False)
    for name, (shape, kind) in fam.tensors(cfg).items():
        if not src.has(name):
            if tied and name in ("lm_head.weight", "head.weight"):
                continue
            raise CpumlaError(f"{where(src)}: checkpoint is missing tensor '{name}'")
        dtype, got = src.info(name)
        to = quant_plan(name, dtype, got, fmt) if kind in ("linear", "plain") else None
        if to is not None:
            stored_linear(src, name, tuple(shape), tuple(cfg.block))     # shape and FP8 scale checks
            rows, cols = shape
            made = {}

            def data(name=name, shape=tuple(shape), made=made):
                w = qz(name, stored_linear(src, name, shape, tuple(cfg.block)))
                made["scale"] = w.scale
                return w.data

            groups.append([(name, Q_DTYPE[to], (rows, cols // (2 if to == "q4" else 1)), data, rows * cols),
                           (name + QSCALE, "F16", (rows, cols // 32), lambda made=made: made.pop("scale"), 0)])
            continue
        group = [(name, dtype, got, lambda name=name: src.tensor(name), 0)]
        for s in (name + "_scale_inv",):
            if src.has(s):
                group.append((s, *src.info(s), lambda s=s: src.tensor(s), 0))
        groups.append(group)
    qz.total = sum(e[4] for g in groups for e in g)
    return groups, qz


def _shards(groups, shard_bytes: int):
    shards, cur, size = [], [], 0
    for g in groups:
        b = sum(nbytes(e[1], tuple(e[2])) for e in g)
        if cur and size + b > shard_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur += g
        size += b
    if cur:
        shards.append(cur)
    return shards


def quantize_checkpoint(model: str, outdir, fmt: str, *, force: bool = False, dummy_weights: bool = False,
                        hf_overrides=None, seed: int = 0, dummy_dtype: str = "bf16", threads: int | None = None,
                        progress=None, shard_bytes: int = SHARD_BYTES) -> dict:
    """Writes the q8 / q4 checkpoint of `model` to outdir; returns a summary (tensors per format, bytes).
    progress(done, total) in weight elements quantized. Raises CpumlaError (outdir untouched then)."""
    if fmt not in QUANTS:
        raise CpumlaError(f"--quant must be one of {', '.join(QUANTS)}, not '{fmt}'")
    cfg, resolved = load_config(model, hf_overrides)
    fam = family(cfg.model_type)
    if resolved.gguf is not None:
        raise CpumlaError(f"{model} is a GGUF model: cpumla quantize reads safetensors checkpoints")
    if quantized_as(cfg):
        raise CpumlaError(f"{model} is already quantized ({quantized_as(cfg)}): quantize its original checkpoint")
    if not getattr(fam, "QUANTIZABLE", True):
        raise CpumlaError(f"quantizing {cfg.model_type} is not supported yet")
    reading = [resolved.directory] if resolved.directory is not None and not dummy_weights else []
    out = check_target(outdir, force=force, reading=reading)
    if reading:
        src = Checkpoint(resolved.directory)
    elif dummy_weights:
        src = DummySource(fam.tensors(cfg), cfg.block, seed=seed, dtype=dummy_dtype)
    else:
        raise CpumlaError(f"'{model}' is a preset (config only): pass --dummy-weights, or download the "
                          f"weights with `cpumla download {model}`")
    native.ensure_init()
    if threads is not None:
        native.set_threads(threads)
    groups, qz = plan(cfg, fam, src, fmt)
    qz.progress = progress
    shards = _shards(groups, shard_bytes)
    written = 0
    try:
        with staged_folder(out, force=force, reading=reading) as tmp:
            names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
            weight_map = {}
            for fname, entries in zip(names, shards):
                written += write_file(tmp / fname, [e[:4] for e in entries], {"format": "pt"})
                weight_map.update({e[0]: fname for e in entries})
            (tmp / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": written}, "weight_map": weight_map},
                                                     indent=2) + "\n")
            d = cfg.to_dict()
            qc = {"quant_method": "cpumla", "format": fmt, "format_version": QUANT_VERSION, "group_size": 32,
                  "scale_suffix": QSCALE, "output_head": "q8",
                  "kept": "MoE router, V3.2 indexer, norms, embeddings, widths not a multiple of 32"}
            old = d.get("quantization_config") or {}
            if old.get("weight_block_size"):         # FP8 tensors kept as stored keep their block size
                qc["weight_block_size"] = old["weight_block_size"]
            d["quantization_config"] = qc
            (tmp / "config.json").write_text(json.dumps(d, indent=2) + "\n")
            for f in sorted(resolved.directory.iterdir()) if reading else ():
                if f.is_file() and f.name not in SKIP_FILES and f.suffix not in (".safetensors", ".bin", ".pt", ".pth"):
                    shutil.copy2(f, tmp / f.name)
            tokenizer = _tokenizer_for(tmp, cfg, resolved)
    finally:
        if hasattr(src, "close"):
            src.close()
    kept = sum(1 for g in groups if g[0][1] not in ("I8", "U8"))
    return {"outdir": str(outdir), "format": fmt, "quantized": dict(qz.formats), "kept": kept, "bytes": written,
            "tokenizer": tokenizer,
            "source_bytes": sum(nbytes(*src_info) for src_info in source_infos(groups, src))}


def _tokenizer_for(folder: Path, cfg, resolved) -> str | None:
    """A folder written without a tokenizer of its own (dummy weights from a preset) gets the bundled
    DeepSeek tokenizer of its family (V2's for deepseek_v2, else V3/V4's) when its vocabulary covers it, so
    that `cpumla chat FOLDER` runs as the preset does. What the folder's tokenizer is, for the summary:
    "own", the bundled one's description, or None (none, say so)."""
    if any((folder / f).is_file() for f in ("tokenizer.json", "tiktoken.model")):
        return "own"
    if "moonlight" in (resolved.repo_id or str(resolved.directory or "")).lower():
        return None
    from cpumla.chat.tokenizer import NAMES, Tokenizer, bundled_name, copy_bundled

    name = bundled_name(cfg.model_type)
    tok = Tokenizer.bundled(name)
    if tok.vocab_size > cfg.vocab_size:
        return None
    copy_bundled(name, folder)
    return f"DeepSeek's {NAMES[name]} tokenizer ({tok.source})"


def source_infos(groups, src):
    """(dtype, shape) as stored of every tensor the plan reads (scale tensors included)."""
    for g in groups:
        for e in g:
            if src.has(e[0]):
                dtype, shape = src.info(e[0])
                yield dtype, tuple(shape)


def quantize(
    model: str = typer.Argument(..., help="Model dir, cached repo id, or preset (presets need --dummy-weights)."),
    outdir: str = typer.Argument(..., help="Directory to create with the quantized checkpoint."),
    quant: str = typer.Option(None, "--quant", help="q8 (8.5 bits a weight) or q4 (4.5)."),
    force: bool = typer.Option(False, "--force", metavar="", help="Replace OUTDIR if it exists."),
    dummy_weights: bool = typer.Option(False, "--dummy-weights", metavar="", help="Deterministic random weights."),
    hf_overrides: str = typer.Option(None, "--hf-overrides", help="JSON merged into the config (as vLLM)."),
    dummy_dtype: str = typer.Option("bf16", "--dummy-dtype", help=f"Dummy weight format: {dummy_dtypes_help()}."),
    seed: int = typer.Option(0, "--seed", help="Dummy weights' seed."),
    threads: int = typer.Option(None, "--threads", "-t", help="Threads (default: one per core)."),
) -> None:
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
    if s["tokenizer"] is None:
        render.err.print(f"note: {s['outdir']} has no tokenizer: chat with it through --tokenizer DIR (a folder with "
                         f"the model's tokenizer.json)", style="yellow", markup=False, highlight=False, soft_wrap=True)
    elif s["tokenizer"] != "own":
        render.err.print(f"note: {s['outdir']}: tokenizer copied in, {s['tokenizer']}, as the preset has "
                         f"none of its own",
                         style="dim", markup=False, highlight=False, soft_wrap=True)
