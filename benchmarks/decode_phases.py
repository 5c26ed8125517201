"""Decode speed as a share of the read bandwidth, split by the host's bandwidth phase.

    python benchmarks/decode_phases.py --model moonshotai/Moonlight-16B-A3B --dummy-dtype fp8 --seconds 110

On a shared host the read bandwidth jumps between phases (here ~47 and ~80 GB/s), sometimes within
seconds, so two `cpumla bench` runs minutes apart compare different machines. This takes many short
samples instead: each is `--tokens` one-token forwards (after a short prefill) with a bandwidth probe
right before and after, and is filed under the phase its probe reads. It prints the mean of decode
GB/s / probe GB/s per phase. To compare two builds, run this alternately with each on PYTHONPATH
(e.g. a clone at the old commit built with `python3 setup.py build_ext --inplace`) and compare the
same phase's rows. The model is cpumla's dummy-weight model (`--layers` layers), as `cpumla bench`
builds it; `--quant q8|q4` quantizes it as it loads.

`--prefetch l1,l2` alternates the samples between GEMV prefetch targets in one process (the same
weights, the same host phases) and files each target's samples apart.

`--turn FILE:I/N` runs N of these side by side, one per build, taking samples in turn (process I takes
a sample when the counter in FILE is I mod N, then adds one), so that every build sees the same host
phases; each waits for all N to have loaded first:

    echo 0 > /tmp/turn
    PYTHONPATH=/tmp/old python3 benchmarks/decode_phases.py --quant q4 --seconds 420 --turn /tmp/turn:0/2 &
    PYTHONPATH=/tmp/new python3 benchmarks/decode_phases.py --quant q4 --seconds 420 --turn /tmp/turn:1/2
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time

import numpy as np

import cpumla
from cpumla import CpumlaError, native
from cpumla.bench import model as rb
from cpumla.cli.overrides import parse_hf_overrides


class Turns:
    """Samples in turn between N processes: a counter in a file, bumped by the one whose turn it is;
    a process that has finished keeps taking no turns but passes them on (leave)."""

    def __init__(self, path: str, me: int, n: int):
        self.path, self.me, self.n = path, me, n

    def _get(self) -> int:
        with open(self.path) as f:
            text = f.read().strip()
        return int(text) if text else 0

    def done(self) -> None:
        """Pass the turn on: the counter plus one."""
        tmp = f"{self.path}.{self.me}.tmp"
        with open(tmp, "w") as f:
            f.write(str(self._get() + 1))
        os.replace(tmp, self.path)

    def ready(self) -> None:
        open(f"{self.path}.ready{self.me}", "w").close()
        while not all(os.path.exists(f"{self.path}.ready{i}") for i in range(self.n)):
            time.sleep(0.05)

    def wait(self) -> None:
        while self._get() % self.n != self.me:
            time.sleep(0.0005)

    def leave(self) -> None:
        """Pass every later turn on, until all have ended (their ready files are gone)."""
        os.remove(f"{self.path}.ready{self.me}")
        while any(os.path.exists(f"{self.path}.ready{i}") for i in range(self.n)):
            if self._get() % self.n == self.me:
                self.done()
            time.sleep(0.0005)


def model_options(ap: argparse.ArgumentParser) -> None:
    """The options of the dummy-weight model, the threads, the phase bounds and --json (decode_jobs.py
    takes them too)."""
    ap.add_argument("--model", default="deepseek-ai/DeepSeek-V2-Lite")
    ap.add_argument("--dummy-dtype", default="bf16", choices=["bf16", "fp8"])
    ap.add_argument("--quant", choices=["q8", "q4"], help="quantize the weights as they load")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hf-overrides", default="{}", help="JSON merged into the config (after --layers)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--slow-below", type=float, default=55.0, help="probe GB/s under which a sample is 'slow'")
    ap.add_argument("--fast-above", type=float, default=65.0, help="probe GB/s over which a sample is 'fast'")
    ap.add_argument("--json", action="store_true", help="one JSON object instead of text")


def load_model(ap: argparse.ArgumentParser, a: argparse.Namespace):
    """The engine of model_options' model, as `cpumla bench` builds it; bad input is the CLI's one-line
    message (ap.error)."""
    try:
        overrides = parse_hf_overrides(a.hf_overrides)
        return cpumla.load(a.model, dummy_weights=True, dummy_dtype=a.dummy_dtype, quant=a.quant,
                           hf_overrides={"num_hidden_layers": a.layers, **overrides})
    except CpumlaError as e:
        ap.error(str(e))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    model_options(ap)
    ap.add_argument("--seconds", type=float, default=110.0, help="how long to take samples")
    ap.add_argument("--tokens", type=int, default=32, help="decoded tokens per sample")
    ap.add_argument("--turn", metavar="FILE:I/N", help="take samples in turn with N-1 other runs (above)")
    ap.add_argument("--prefetch", metavar="T,T", help="GEMV prefetch targets (l1, l2, l2+l1, auto) the samples "
                    "take in turn, each filed apart (cpumla_set_gemv_prefetch)")
    a = ap.parse_args(argv)
    if a.tokens < 1 or a.threads < 1:
        ap.error("--tokens and --threads must be at least 1")
    targets = [t.strip() for t in a.prefetch.split(",")] if a.prefetch else [None]
    for t in targets:
        if t is not None and t not in ("l1", "l2", "l2+l1", "auto"):
            ap.error(f"--prefetch takes l1, l2, l2+l1 or auto, not '{t}'")
    turn = None
    if a.turn:
        m = re.fullmatch(r"(.+):(\d+)/(\d+)", a.turn)
        if not m or not int(m.group(2)) < int(m.group(3)):
            ap.error(f"--turn must be FILE:I/N with I < N, not '{a.turn}'")
        turn = Turns(m.group(1), int(m.group(2)), int(m.group(3)))
        if not os.path.isfile(turn.path):
            ap.error(f"--turn: no counter file {turn.path} (write 0 to it first)")
    eng = load_model(ap, a)

    native.set_threads(a.threads)
    probe = rb.BandwidthProbe()                 # a buffer of its own, far larger than the caches
    per_token = rb.decode_bytes(eng, 64)
    rng = np.random.default_rng(0)
    samples = []                                # (decode GB/s, probe GB/s, prefetch target index)
    if turn:
        turn.ready()
    end = time.time() + a.seconds
    while len(samples) < len(targets) or time.time() < end:     # at least one sample a target
        if turn:
            turn.wait()
        ti = len(samples) % len(targets)
        if targets[ti]:
            native.set_gemv_prefetch(targets[ti])
        eng.reset()
        eng.forward(rng.integers(0, eng.config.vocab_size, size=48), last_only=True)
        before = probe(2)
        t0 = time.perf_counter()
        for tok in rng.integers(0, eng.config.vocab_size, size=a.tokens):
            eng.forward([int(tok)], last_only=True)
        dt = time.perf_counter() - t0
        samples.append((per_token * a.tokens / dt / 1e9, (before + probe(2)) / 2, ti))
        if turn:
            turn.done()
    if turn:
        turn.leave()

    s = np.array(samples)
    out = {"model": a.model, "dummy_dtype": a.dummy_dtype, "quant": a.quant, "isa": native.isa(),
           "tokens_per_sample": a.tokens, "bytes_per_token": per_token}

    def phases(rows: np.ndarray) -> dict:
        keep = {"slow": rows[:, 1] < a.slow_below, "fast": rows[:, 1] > a.fast_above, "all": np.ones(len(rows), bool)}
        return {name: {"samples": int(m.sum()),
                       "pct_probe": float(100 * np.mean(rows[m, 0] / rows[m, 1])) if m.any() else None,
                       "probe_gbs": float(np.mean(rows[m, 1])) if m.any() else None} for name, m in keep.items()}

    if a.prefetch:
        out["prefetch"] = {t: phases(s[s[:, 2] == i]) for i, t in enumerate(targets)}
    else:
        out.update(phases(s))
    if a.json:
        print(json.dumps(out))
        return
    weights = a.dummy_dtype + (f" as {a.quant}" if a.quant else "")
    print(f"{a.model} ({weights}, {a.layers} layers, {native.isa()}), {per_token / 1e6:.0f} MB per token")
    for label, per_phase in (out["prefetch"].items() if a.prefetch else [("", out)]):
        for name in ("slow", "fast", "all"):
            r, head = per_phase[name], f"{label} {name}" if label else name
            if r["samples"]:
                print(f"{head:8s} {r['pct_probe']:5.1f}% of the probe ({r['samples']} samples, probe {r['probe_gbs']:.1f} GB/s)")
            else:
                print(f"{head:8s} no samples")


if __name__ == "__main__":
    main()
