"""Decode of N tensor-parallel ranks against one process with as many threads in all, alternating in one
run, plus the ranks' all-reduce latency.

    python benchmarks/tp_decode.py                                   # V2-Lite widths, 4 layers, --tp 2
    python benchmarks/tp_decode.py --model deepseek-ai/DeepSeek-V3 --hf-overrides '{"num_hidden_layers": 3, "first_k_dense_replace": 1, "n_routed_experts": 32}'

The model is cpumla's dummy-weight model saved as a bf16 safetensors checkpoint (benchmarks/compare.py's
save_dummy), so the one process and every rank map the same file and share its pages. The one
process runs with --threads T (default: every core), each of the N ranks with T / N; each round decodes
--tokens greedy tokens after a 16-token prompt in either, one after the other. Prints each round's
tok/s and the median ratio (ranks over one process).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare import save_dummy  # noqa: E402


def decode(eng, threads: int, cpus, prompt: list[int], n: int) -> float:
    from cpumla import native

    native.set_threads(threads)
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cpus)
    eng.reset()
    logits = eng.forward(prompt, last_only=True)
    t0 = time.perf_counter()
    for _ in range(n):
        logits = eng.forward([int(np.argmax(logits[-1]))], last_only=True)
    return n / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="deepseek-ai/DeepSeek-V2-Lite")
    ap.add_argument("--hf-overrides", default='{"num_hidden_layers": 4}')
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="the one process's threads")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    import cpumla
    from cpumla.bench.tp import run as tp_run
    from cpumla.bench.model import AtDepth
    from cpumla.native import cpu_name

    with tempfile.TemporaryDirectory(prefix="cpumla-tp-bench-") as tmp:
        path = Path(tmp)
        save_dummy(args.model, args.hf_overrides, args.seed, path)
        every = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        ctx = 16 + args.tokens + 64
        one = cpumla.load(str(path), threads=args.threads, max_seq_len=ctx, draft="none")
        per = max(1, args.threads // args.tp)
        ranks = cpumla.load(str(path), tp=args.tp, threads=per, max_seq_len=ctx, draft="none")
        mine = sorted(os.sched_getaffinity(0)) if every is not None else None    # rank 0's slice (tp.start)
        prompt = list(range(1, 17))
        for eng, t, c in ((one, args.threads, every), (ranks, per, mine)):       # warm-up: pages in
            decode(eng, t, c, prompt, 4)
        a, b = [], []
        for r in range(args.rounds):
            a.append(decode(one, args.threads, every, prompt, args.tokens))
            b.append(decode(ranks, per, mine, prompt, args.tokens))
            print(f"round {r}: 1 process x {args.threads} threads {a[-1]:.2f} tok/s, {args.tp} ranks x {per} "
                  f"threads {b[-1]:.2f} tok/s, ratio {b[-1] / a[-1]:.3f}", flush=True)
        ratio = statistics.median(x / y for x, y in zip(b, a))
        lat = tp_run(ranks, AtDepth(ranks, 0, np.random.default_rng(1)), per)
        print(f"CPU: {cpu_name()}; model {args.model} {args.hf_overrides}, bf16")
        print(f"decode, {args.tp} ranks x {per} threads over 1 process x {args.threads} threads: median ratio "
              f"{ratio:.3f} ({statistics.median(b):.2f} against {statistics.median(a):.2f} tok/s)")
        print(f"all-reduce of {lat.floats} floats over {lat.transport}: p50 {lat.p50_us:.1f} us, p99 {lat.p99_us:.1f} us;"
              f" rank 0 communicates {lat.comm_ms:.2f} ms of a {lat.token_ms:.2f} ms token, waits included")
        ranks.close()
        one.close()


if __name__ == "__main__":
    main()
