"""Decode against a replay of its own GEMV jobs alone, and each job's read rate.

    python benchmarks/decode_jobs.py --quant q8 --seconds 120

A decode token of a DeepSeek V2 / V3 layout model is a few large jobs on the thread pool (q_proj,
kv_a_proj, o_proj, the router, the routed and shared experts, the dense MLP, the output head) with
small steps between them (norms, RoPE, the latent cache, the absorb and attention, routing, Python). This
takes samples of `--tokens` one-token forwards in turn with samples of a replay that runs only those
jobs (`cpumla_gemv` / `cpumla_moe` on the model's own weights, in the forward's order, random experts)
with the read probe around each, and prints the mean share of the probe of both per phase of the
probe. Decode level with its replay says the steps between jobs cost nothing measurable; below it, by how
much. Then it times each job of the replay apart for `--job-seconds` and prints its MB, microseconds and
share of the probe: a job far below the others of its size is the place to look. The model is cpumla's
dummy-weight model with `--layers` layers, as `cpumla bench` builds it; `--quant q8|q4` quantizes it as
it loads. Bytes per job are the weights' bytes (codes and scales) that the job reads once. V3.2's
indexer projections are not among the replayed jobs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from cpumla import CpumlaError, native
from cpumla.bench import model as rb

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_phases import load_model, model_options  # noqa: E402  (the same model options and loading)


def weight_bytes(w) -> int:
    return w.data.nbytes + (w.scale.nbytes if w.scale is not None else 0)


def expert_bytes(experts) -> int:
    """the bytes of one expert of a table (every expert of a layer has the same shapes)"""
    return sum(weight_bytes(w) for w in experts._keep[0])


def jobs_of(model, top_k: int) -> list[tuple[str, str, object, int]]:
    """(name, kind, native handle, bytes) of each job of a decode token, in the forward's order; kind is
    gemv (one weight), moe (top_k of a layer's routed experts) or mlp (a one-expert table)"""
    layers = getattr(model, "layers", None)
    if not layers or not all(hasattr(L, "kv_a") and hasattr(L, "experts") for L in layers):
        raise CpumlaError(f"decode_jobs.py replays the DeepSeek V2 / V3 layer layout; "
                          f"{type(model).__module__} has another")
    out = []
    for i, L in enumerate(layers):
        for name in ("q", "q_a", "q_b", "kv_a", "o_proj", "gate"):
            w = getattr(L, name)
            if w is not None:
                out.append((f"layer {i} {name}", "gemv", w.c, weight_bytes(w)))
        if L.experts is not None:
            out.append((f"layer {i} routed experts ({top_k} of {L.experts.n})", "moe", L.experts,
                        top_k * expert_bytes(L.experts)))
        mlp = L.mlp if L.mlp is not None else getattr(L, "shared", None)
        if mlp is not None:
            out.append((f"layer {i} {'shared experts' if L.experts is not None else 'dense MLP'}", "mlp", mlp,
                        expert_bytes(mlp)))
    out.append(("output head", "gemv", model.lm_head.c, weight_bytes(model.lm_head)))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    model_options(ap)
    ap.add_argument("--seconds", type=float, default=60.0, help="how long to take decode / replay samples")
    ap.add_argument("--job-seconds", type=float, default=20.0, help="how long to time the jobs one by one")
    ap.add_argument("--tokens", type=int, default=32, help="tokens (replays) per sample")
    a = ap.parse_args(argv)
    if a.tokens < 1 or a.threads < 1 or a.seconds < 0 or a.job_seconds < 0:
        ap.error("--tokens and --threads must be at least 1, the seconds not negative")
    eng = load_model(ap, a)
    try:
        top_k = int(getattr(eng.config, "num_experts_per_tok", None) or 1)
        jobs = jobs_of(eng.model, top_k)
    except CpumlaError as e:
        ap.error(str(e))

    native.set_threads(a.threads)
    ffi, lib = native.ffi, native.lib
    probe = rb.BandwidthProbe()
    per_token = rb.decode_bytes(eng, 64)
    replay_bytes = sum(b for *_, b in jobs)
    rng = np.random.default_rng(0)
    D = eng.config.hidden_size
    x = np.full(max(D, max(getattr(h, "cols", 0) for _, k, h, _ in jobs if k == "gemv")), 0.01, np.float32)
    y = np.zeros(max(getattr(h, "rows", 0) for _, k, h, _ in jobs if k == "gemv"), np.float32)
    h_out = np.zeros(D, np.float32)
    xp, yp, hp = native.fptr(x), native.fptr(y), native.fptr(h_out)
    wts = ffi.new("float[]", [1.0 / top_k] * top_k)
    zero, one = ffi.new("int32_t[]", [0]), ffi.new("float[]", [1.0])
    n_exp = max([h.n for _, k, h, _ in jobs if k == "moe"], default=1)
    picks = [ffi.new("int32_t[]", [int(e) for e in rng.choice(n_exp, top_k, replace=top_k > n_exp)])
             for _ in range(64)]                 # drawn before any timing
    drawn = [0]

    def run(kind, handle) -> None:
        if kind == "gemv":
            rc = lib.cpumla_gemv(handle, xp, yp)
        elif kind == "moe":
            drawn[0] += 1
            rc = lib.cpumla_moe(handle.c, handle.n, xp, D, 1, picks[drawn[0] % len(picks)], wts, top_k, hp, D, 0.0)
        else:
            rc = lib.cpumla_moe(handle.c, 1, xp, D, 1, zero, one, 1, hp, D, 0.0)
        if rc != 0:
            raise SystemExit(f"decode_jobs.py: a replayed job failed: {native.last_error()}")

    def replay() -> None:
        for _, kind, handle, _ in jobs:
            run(kind, handle)

    replay()                                    # first touches, workers started
    samples = []                                # (0 decode / 1 replay, GB/s, probe GB/s)
    end = time.time() + a.seconds
    while len(samples) < 2 or time.time() < end:
        which = len(samples) % 2
        if which == 0:
            eng.reset()
            eng.forward(rng.integers(0, eng.config.vocab_size, size=48), last_only=True)
        before = probe(2)
        t0 = time.perf_counter()
        for tok in rng.integers(0, eng.config.vocab_size, size=a.tokens):
            if which == 0:
                eng.forward([int(tok)], last_only=True)
            else:
                replay()
        dt = time.perf_counter() - t0
        samples.append((which, (per_token, replay_bytes)[which] * a.tokens / dt / 1e9, (before + probe(2)) / 2))

    spent = np.zeros(len(jobs))                 # each job timed apart, the probe around each round
    rounds, probes = 0, []
    end = time.time() + a.job_seconds
    while rounds == 0 or time.time() < end:
        before = probe(2)
        for j, (_, kind, handle, _) in enumerate(jobs):
            t0 = time.perf_counter()
            run(kind, handle)
            spent[j] += time.perf_counter() - t0
        probes.append((before + probe(2)) / 2)
        rounds += 1
    job_probe = float(np.mean(probes))

    s = np.array(samples)
    out = {"model": a.model, "dummy_dtype": a.dummy_dtype, "quant": a.quant, "isa": native.isa(),
           "threads": a.threads, "bytes_per_token": per_token, "replay_bytes": replay_bytes, "phases": {},
           "job_probe_gbs": job_probe, "jobs": []}
    for phase, keep in (("slow", s[:, 2] < a.slow_below), ("fast", s[:, 2] > a.fast_above),
                        ("all", np.ones(len(s), bool))):
        row = {}
        for which, name in ((0, "decode"), (1, "replay")):
            m = keep & (s[:, 0] == which)
            if m.any():
                row[name] = {"samples": int(m.sum()), "probe_gbs": float(s[m, 2].mean()),
                             "pct_probe": float(100 * (s[m, 1] / s[m, 2]).mean())}
        if row:
            out["phases"][phase] = row
    for j, (name, kind, _, nbytes) in enumerate(jobs):
        us = spent[j] / rounds * 1e6
        out["jobs"].append({"job": name, "mb": nbytes / 1e6, "us": us,
                            "pct_probe": 100 * nbytes / (us * 1e-6) / 1e9 / job_probe})
    if a.json:
        print(json.dumps(out))
        return
    print(f"{a.model} ({a.dummy_dtype}{' as ' + a.quant if a.quant else ''}, {a.layers} layers, "
          f"{native.isa()}, {a.threads} threads): {per_token / 1e6:.0f} MB a token, its jobs {replay_bytes / 1e6:.0f} MB")
    for phase, row in out["phases"].items():
        print(f"{phase:5s} " + "   ".join(f"{name} {r['pct_probe']:.1f}% of the probe ({r['samples']} samples, "
                                            f"probe {r['probe_gbs']:.1f} GB/s)" for name, r in row.items()))
    print(f"each job apart, {rounds} rounds, probe {job_probe:.1f} GB/s:")
    for r in out["jobs"]:
        print(f"  {r['job']:42s} {r['mb']:8.2f} MB {r['us']:9.0f} us {r['pct_probe']:6.1f}%")


if __name__ == "__main__":
    main()
