"""q8 / q4 against the bf16 model they come from: KL divergence of the next-token distributions and
top-1 agreement over a few hundred positions, on a model with dummy weights (or a real checkpoint).

    python3 benchmarks/quant_quality.py [--model M] [--dummy-weights] [--hf-overrides JSON] [-n 256]
        [--head-q4]      # also the variant with the output head in q4 (the default keeps it q8)

Prints one row per variant: mean and max KL(bf16 || variant) in nats, top-1 agreement, and the bytes
of the linear weights relative to bf16.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

import cpumla
from cpumla.runtime import weights as W


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
    a = ap.parse_args()
    ov = json.loads(a.hf_overrides)
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
    print("| variant | mean KL (nats) | max KL | top-1 agreement | linear bytes vs bf16 |")
    print("|---|---:|---:|---:|---:|")
    plan = W.quant_plan
    for label, fmt, head in variants:
        if head:
            W.quant_plan = lambda name, dtype, shape, f, head=head: \
                head if plan(name, dtype, shape, f) == "q8" and f == "q4" else plan(name, dtype, shape, f)
        eng = cpumla.load(a.model, quant=fmt, **kw)
        W.quant_plan = plan
        got = log_softmax(eng.forward(ids))
        kl = (np.exp(ref) * (ref - got)).sum(-1)
        top1 = float((ref.argmax(-1) == got.argmax(-1)).mean())
        print(f"| {label} | {kl.mean():.4f} | {kl.max():.4f} | {100 * top1:.1f}% | "
              f"{linear_bytes(eng) / ref_bytes:.3f} |")
        eng.close()


if __name__ == "__main__":
    main()
