"""Decode of a checkpoint larger than RAM: routed experts read from disk (cpumla's expert slots, direct
I/O, the next layer's experts read ahead) against the same checkpoint mapped and run from the page cache,
as before. The runs alternate (`cpumla bench MODEL -p 0 -n N -r R -o json`, with `--memory` the budget of
the streamed runs and `--memory 1T` for the mapped ones, which makes everything "fit"); each mapped run
follows another mapped run, so that the page cache it reads from is as warm as it gets (a streamed run
drops the file's cached pages when it starts). Reported: tok/s, the expert hit rate, the bytes a token
reads from disk and their GB/s against the direct-read probe of the same run, and the bound that probe
sets (probe GB/s over the missed expert bytes a token).

    cpumla quantize deepseek-ai/DeepSeek-V2-Lite-Chat /work/big-q4 --quant q4 --dummy-weights \\
        --hf-overrides '{"n_routed_experts": 320}'
    python3 benchmarks/streaming.py /work/big-q4 -n 16 -r 3 --rounds 2
    python3 benchmarks/streaming.py /work/big-q4 --policies      # LRU against LFU on routing traces

With --llama-bin, the model is a GGUF file and llama.cpp's `llama-bench` (mapped, its default) takes a
third turn in each round. Such a file, of V2-Lite's 27 layers with 320 experts a layer, comes from a
small GGUF of V2-Lite's widths (benchmarks/gguf_models.py --keep writes them) with --make-gguf: its
metadata, tokenizer included, and its tensor types; each layer's tensors are those of the template's
layer 1 + (l - 1) % 3 and the routed experts its experts repeated (valid blocks), the routers new random
F32 (near-uniform routing, the worst case for a cache).

    python3 benchmarks/streaming.py --make-gguf /work/gguf-bench/model-Q4_K_M.gguf /work/big-q4km.gguf
    python3 benchmarks/streaming.py /work/big-q4km.gguf --llama-bin /work/llama/build/bin
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys


def bench(model: str, memory: str, n: int, reps: int, threads: int | None, extra: list[str]) -> dict:
    cmd = [sys.executable, "-m", "cpumla", "bench", model, "-p", "0", "-n", str(n), "-r", str(reps), "-o", "json",
           "--memory", memory, *(["-t", str(threads)] if threads else []), *extra]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{p.stderr}")
    return json.loads(p.stdout)[0]


def llama_bench(bin_dir: str, model: str, n: int, reps: int, threads: int | None) -> float:
    cmd = [f"{bin_dir}/llama-bench", "-m", model, "-p", "0", "-n", str(n), "-r", str(reps), "-o", "json",
           "--repack", "0", *(["-t", str(threads)] if threads else [])]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{p.stderr[-2000:]}")
    return float(json.loads(p.stdout)[0]["avg_ts"])


def make_gguf(template: str, out: str, layers: int = 27, experts: int = 320, seed: int = 0) -> None:
    """A GGUF of `layers` layers and `experts` routed experts a layer from a small one (see the docstring),
    written tensor by tensor (bounded memory)."""
    import gguf
    import numpy as np

    r = gguf.GGUFReader(template)
    arch = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(out, arch)
    V = gguf.GGUFValueType
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        value = f.contents()
        if name == f"{arch}.block_count":
            value = layers
        elif name == f"{arch}.expert_count":
            value = experts
        sub = f.types[1] if f.types[0] == V.ARRAY and len(f.types) > 1 else None
        w.add_key_value(name, value, f.types[0], sub_type=sub)
    by_name = {t.name: t for t in r.tensors}
    plan = []                                                # (new name, template tensor, new numpy shape)
    for t in r.tensors:
        if not t.name.startswith("blk."):
            plan.append((t.name, t, None))
    n_tmpl = 1 + max(int(t.name.split(".")[1]) for t in r.tensors if t.name.startswith("blk."))
    for l in range(layers):
        src = l if l == 0 else 1 + (l - 1) % (n_tmpl - 1)
        for t in r.tensors:
            if t.name.startswith(f"blk.{src}."):
                plan.append((f"blk.{l}." + t.name.split(".", 2)[2], t, None))
    rng = np.random.default_rng(seed)
    shapes = []
    for name, t, _ in plan:
        shape = [int(x) for x in reversed(t.shape)]          # numpy order
        if "_exps." in name or name.endswith("ffn_gate_inp.weight"):
            shape[0] = experts
        nbytes = t.n_bytes * shape[0] // int(t.shape[-1]) if shape[0] != int(t.shape[-1]) else t.n_bytes
        shapes.append(shape)
        plain = {gguf.GGMLQuantizationType.F32: np.float32, gguf.GGMLQuantizationType.F16: np.float16}
        if t.tensor_type in plain:
            w.add_tensor_info(name, shape, np.dtype(plain[t.tensor_type]), nbytes, raw_dtype=t.tensor_type)
        else:                                                # the writer takes a block type's shape in bytes
            block, size = gguf.GGML_QUANT_SIZES[t.tensor_type]
            w.add_tensor_info(name, shape[:-1] + [shape[-1] // block * size], np.dtype(np.uint8), nbytes,
                              raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for (name, t, _), shape in zip(plan, shapes):
        data = np.asarray(by_name[t.name].data)
        if name.endswith("ffn_gate_inp.weight"):
            out_arr = (rng.standard_normal(shape, dtype=np.float32) * 0.05).astype(np.float32)
        elif "_exps." in name:
            per = data.reshape(int(t.shape[-1]), -1)
            out_arr = np.concatenate([per[i % per.shape[0]][None] for i in range(shape[0])])
        else:
            out_arr = data
        w.write_tensor_data(np.ascontiguousarray(out_arr))
    w.close()


def policies(model: str, memory: str | None, warm: int, tokens: int, skew: float, seed: int = 0) -> None:
    """The slot policies on routing traces: every routed table of the model, streamed, is called as decode
    calls it (one token, top_k experts) with the experts of a synthetic router: uniform (what dummy
    weights give: the worst case) and skewed (expert r of a layer's own random ranking chosen with
    probability ~ 1 / (r + 1)^skew). Hit rates over `tokens` tokens after `warm` tokens of the same trace."""
    import numpy as np

    import cpumla
    from cpumla.cli.options import parse_size

    for policy in ("lru", "lfu"):
        eng = cpumla.load(model, max_seq_len=16, memory=parse_size(memory) if memory else None,
                          expert_policy=policy)
        tables, k = eng.model.routed_tables(), eng.config.num_experts_per_tok
        D = tables[0].hidden
        x = np.full((1, D), 0.01, np.float32)
        out = np.zeros((1, D), np.float32)
        w = np.full((1, k), 1.0 / k, np.float32)
        for trace in ("uniform", f"skewed {skew}"):
            rng = np.random.default_rng(seed)
            E = tables[0].n
            ranks = [rng.permutation(E) for _ in tables]
            p = 1.0 / (np.arange(E) + 1.0) ** skew
            p /= p.sum()
            for i in range(warm + tokens):
                if i == warm:
                    eng.stream.reset_stats()
                for t, rank in zip(tables, ranks):
                    chosen = rng.choice(E, k, replace=False) if trace == "uniform" else \
                        rank[rng.choice(E, k, replace=False, p=p)]
                    t(x, chosen[None].astype(np.int32), w, out)
            st = eng.stream.stats()
            print(f"| {policy} | {trace} | {st.slots} of {E * len(tables)} | {100 * st.hit_rate:.1f}% | "
                  f"{st.bytes_read / tokens / 1e6:.0f} |")
        eng.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?")
    ap.add_argument("-n", type=int, default=16, help="decode tokens a run")
    ap.add_argument("-r", type=int, default=3, help="measured runs a bench (after a warm-up)")
    ap.add_argument("--rounds", type=int, default=2, help="alternations of the two paths")
    ap.add_argument("--memory", default=None, help="the streamed runs' budget (default: what is available)")
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--llama-bin", default=None, help="llama.cpp's build/bin: llama-bench takes a turn (a GGUF)")
    ap.add_argument("--make-gguf", nargs=2, metavar=("TEMPLATE", "OUT"), help="write the big GGUF, then stop")
    ap.add_argument("--policies", action="store_true", help="hit rates of the slot policies on routing traces")
    ap.add_argument("--skew", type=float, default=1.0, help="--policies: the skewed router's exponent")
    args = ap.parse_args()
    if args.policies:
        print("| policy | routing | slots of experts | hit rate | MB read / token |\n| --- | --- | ---: | ---: | ---: |")
        policies(args.model, args.memory, 64, 192, args.skew)
        return
    if args.make_gguf:
        make_gguf(*args.make_gguf)
        return
    if args.model is None:
        ap.error("name the model to measure")
    streamed_mem = args.memory or ""
    rows = {"streamed": [], "mapped": []}
    llama = []
    for _ in range(args.rounds):
        if args.llama_bin:
            llama_bench(args.llama_bin, args.model, args.n, 1, args.threads)        # its page cache warms up
            llama.append(llama_bench(args.llama_bin, args.model, args.n, args.r, args.threads))
        bench(args.model, "1T", args.n, 1, args.threads, [])                       # the page cache warms up
        rows["mapped"].append(bench(args.model, "1T", args.n, args.r, args.threads, []))
        mem = streamed_mem or str(available())
        rows["streamed"].append(bench(args.model, mem, args.n, args.r, args.threads, []))
    cpu = rows["streamed"][0]["cpu_info"]
    print(f"{args.model}: decode tg{args.n}, {args.rounds} rounds, on {cpu}\n")
    print("| path | tok/s | expert hit rate | disk MB / token | disk GB/s | probe GB/s | % of probe | bound tok/s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, rs in rows.items():
        ts = statistics.median(r["avg_ts"] for r in rs)
        if name == "mapped":
            print(f"| mapped (page cache) | {ts:.2f} | | | | | | |")
            continue
        med = lambda k: statistics.median(r[k] for r in rs)   # noqa: E731
        mb, gbs, probe, hit = med("disk_bytes_per_token") / 1e6, med("disk_read_gbps"), med("disk_probe_gbps"), \
            med("expert_hit_rate")
        print(f"| experts from disk | {ts:.2f} | {100 * hit:.0f}% | {mb:.0f} | {gbs:.2f} | {probe:.2f} | "
              f"{100 * gbs / probe:.0f}% | {probe * 1e3 / mb:.2f} |")
    if llama:
        print(f"| llama.cpp llama-bench (mapped) | {statistics.median(llama):.2f} | | | | | | |")
    streamed = statistics.median(r["avg_ts"] for r in rows["streamed"])
    print(f"\nexperts from disk / mapped: {streamed / statistics.median(r['avg_ts'] for r in rows['mapped']):.2f}x"
          + (f"; / llama.cpp: {streamed / statistics.median(llama):.2f}x" if llama else ""))


def available() -> int:
    from cpumla.runtime.memory import available_memory

    return available_memory()[0]


if __name__ == "__main__":
    main()
