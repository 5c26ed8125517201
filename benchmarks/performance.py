"""Regenerates docs/performance.md, and the performance table of README.md, from measurements taken now.

    python3 benchmarks/performance.py                                   # every section cpumla measures alone
    python3 benchmarks/performance.py --llama-lib BUILD/bin --convert LLAMA_CPP/convert_hf_to_gguf.py
    python3 benchmarks/performance.py --sections kernels,decode         # only these; the others stay as they are

Each section runs the commands it shows (`cpumla bench`, benchmarks/compare.py, benchmarks/quant_quality.py)
and writes its tables with the commit, the CPU and the date they were measured on. Sections not asked for
keep their current text, so a page can be brought up to date a section at a time. llama.cpp's side runs
through llama-cpp-python's Python code (PYTHONPATH=<its sdist>) on the libraries of --llama-lib; without
--llama-lib and --convert the peers section measures transformers alone.

Run it on a quiet machine: a shared host's bandwidth drifts within minutes, so every decode figure is
also given as a share of a read probe taken in the same run, and engines are compared by alternating
them (compare.py), never by separate runs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "performance.md"
README = ROOT / "README.md"
REF = ["deepseek-ai/DeepSeek-V2-Lite", "--dummy-weights", "--hf-overrides", '{"num_hidden_layers": 4}']
SECTIONS = ("decode", "depth", "long", "kernels", "formats", "peers")


SHOWN: dict[str, str] = {}     # paths of this machine -> what the page shows for them


def sh(cmd: list[str]) -> str:
    """cmd as one would type it (this machine's llama.cpp paths as placeholders)."""
    cmd = [SHOWN.get(c, c) for c in cmd]
    return " ".join(c if c.startswith("<") or re.fullmatch(r"[\w./,=:@+-]+", c) else "'" + c + "'" for c in cmd)


def run(cmd: list[str], env: dict | None = None) -> str:
    """stdout of cmd (`cpumla` is this checkout's); its stderr passes through. A failure stops the page."""
    exe = [sys.executable, "-m", "cpumla", *cmd[1:]] if cmd[0] == "cpumla" else \
        [sys.executable, *cmd[1:]] if cmd[0] == "python3" else cmd
    print("$ " + " ".join(cmd), file=sys.stderr, flush=True)
    p = subprocess.run(exe, cwd=ROOT, stdout=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})
    if p.returncode != 0:
        raise SystemExit(f"performance.py: `{sh(cmd)}` failed (exit {p.returncode})")
    return p.stdout


def with_path(extra: str) -> str:
    """PYTHONPATH with `extra` after what it holds (this checkout's cpumla stays first)."""
    return os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), extra) if p)


def md_tables(text: str, captions: bool = True) -> list[str]:
    """The markdown tables in a script's output, each with the line just above it (its caption)."""
    out, lines = [], text.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("|"):
            j = i
            while j < len(lines) and lines[j].startswith("|"):
                j += 1
            caption = next((lines[k] for k in range(i - 1, -1, -1) if lines[k].strip()), "")
            out.append((caption.strip() + "\n\n" if caption.strip() and captions else "") + "\n".join(lines[i:j]))
            i = j
        else:
            i += 1
    return out


def table(head: list[str], rows: list[list], right: int = 1) -> str:
    """A markdown table; columns from `right` on are right-aligned."""
    rule = ["---" if i < right else "---:" for i in range(len(head))]
    return "\n".join("| " + " | ".join(str(c) for c in r) + " |" for r in [head, rule, *rows])


# ---- the machine ----------------------------------------------------------------------------------
def machine() -> dict:
    info = json.loads(run(["cpumla", "info", "--json"]))
    model = info["cpu"]
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        model = re.search(r"Model name:\s*(.+)", lscpu).group(1).strip()
        fam = re.search(r"CPU family:\s*(\d+)", lscpu)
        mod = re.search(r"Model:\s*(\d+)", lscpu)
        if fam and mod:
            model += f" (family {fam.group(1)}, model {mod.group(1)})"
    except (OSError, AttributeError):
        pass
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip() or "unknown"
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                           capture_output=True, text=True).stdout.strip()
    return {"cpu": model, "cores": os.cpu_count(), "isa": info["implementation"], "threads": info["threads"],
            "commit": commit + (" (with local changes)" if dirty else ""),
            "date": datetime.date.today().isoformat(), "prefetch": info["gemv_prefetch"]}


def stamp(m: dict, cmds: list[list[str]], env: dict | None = None) -> str:
    """Where and when a section was measured, and how (env: the variables the commands ran with)."""
    pre = "".join(f"{k}={SHOWN.get(v, v)} " for k, v in (env or {}).items())
    return (f"Measured {m['date']} at commit {m['commit']} on {m['cpu']}, {m['threads']} threads, level "
            f"`{m['isa']}`:\n\n```sh\n" + "\n".join(pre + sh(c) for c in cmds) + "\n```\n")


# ---- sections ---------------------------------------------------------------------------------------
def bench(cmd: list[str]) -> list[dict]:
    return json.loads(run(cmd + ["-o", "json"]))


def decode(m: dict, a) -> str:
    runs = [("V2-Lite widths", "bf16", REF + ["-p", "512", "-n", "64", "-r", "3"]),
            ("V2-Lite widths", "q8", REF + ["-p", "512", "-n", "64", "-r", "3", "--quant", "q8"]),
            ("V2-Lite widths", "q4", REF + ["-p", "512", "-n", "64", "-r", "3", "--quant", "q4"]),
            ("Moonlight (V3 family)", "FP8", ["moonshotai/Moonlight-16B-A3B", "--dummy-weights", "--dummy-dtype", "fp8",
                                              "--hf-overrides", '{"num_hidden_layers": 4}', "-p", "512", "-n", "64", "-r", "3"]),
            ("V4-Flash widths", "FP8 + FP4 experts", ["deepseek-ai/DeepSeek-V4-Flash", "--dummy-weights", "--hf-overrides",
                                                      '{"num_hidden_layers": 4}', "-p", "512", "-n", "32", "-r", "2"])]
    rows, cmds, peaks = [], [], set()
    for name, fmt, args in runs:
        cmd = ["cpumla", "bench", *args]
        cmds.append(cmd)
        res = bench(cmd)
        pp = next(r for r in res if r["n_prompt"])
        tg = next(r for r in res if r["n_gen"])
        # the two arithmetic probes `cpumla bench` measures (bench/peaks.py says which bounds what)
        peaks.add((round(pp["fma_peak_gflops"]), round(pp["bf16_peak_gflops"])))
        rows.append([name, fmt, f"{pp['avg_ts']:.1f}", f"{pp['gflops']:.0f}", f"{tg['avg_ts']:.2f}",
                     f"{tg['bytes_per_token'] / 1e9:.3f}", f"{tg['gbs']:.1f}",
                     f"{tg['pct_bandwidth']:.0f}% of {tg['read_probe_gbs']:.1f}"])
    fma, dot = max(peaks)
    return ("## Decode and prefill\n\nFour layers of each model's real widths on dummy weights (every family's "
            "per-token work, a size that fits here). Decode is bound by the bytes a token reads: its GB/s is "
            "given against a read probe of the same run. Prefill is bound by arithmetic: the runs' probes "
            f"measured {fma} GFLOP/s of fp32 FMAs and {dot} of bf16 dot products on every thread (a level with "
            "AMX runs prefill on its tiles, above both).\n\n" + stamp(m, cmds) + "\n" +
            table(["model", "weights", "pp512 tok/s", "prefill GFLOP/s", "decode tok/s", "GB a token",
                   "decode GB/s", "of the read probe (GB/s)"], rows, right=2) + "\n")


def depth(m: dict, a) -> str:
    cmds = [["cpumla", "bench", *REF, "-p", "0", "-n", "64", "-r", "3", "-d", "0,2048,8192"]]
    sparse = ["-p", "0", "-n", "32", "-r", "2", "-d", "0,8192"]
    for model in ("deepseek-ai/DeepSeek-V3", "deepseek-ai/DeepSeek-V3.2"):
        cmds.append(["cpumla", "bench", model, "--dummy-weights", "--dummy-dtype", "fp8", "--hf-overrides",
                     '{"num_hidden_layers": 4, "n_routed_experts": 64}', *sparse])
    rows = []
    for cmd in cmds:
        res = bench(cmd)
        base = next(r["avg_ts"] for r in res if r["n_depth"] == 0)
        for r in res:
            rows.append([cmd[2].split("/")[-1], r["n_depth"], f"{r['avg_ts']:.2f}", f"{100 * r['avg_ts'] / base:.0f}%",
                         f"{r['pct_bandwidth']:.0f}%"])
    return ("## Decode at depth\n\nThe latent cache grows by `kv_lora_rank + rope_dim` values a token, so "
            "absorbed MLA decode slows little with depth; V3.2's indexer attends to at most `index_topk` "
            "(2048) cached tokens, so its decode stays near its depth-0 speed where V3's falls.\n\n" + stamp(m, cmds)
            + "\n" + table(["model", "depth", "decode tok/s", "of depth 0", "of the read probe"], rows) + "\n")


# one MoE layer of V3 and V3.2, a CSA and an HCA layer of V4-Flash: (name, repo, overrides, layers of the
# full model the measured layers stand for, measured layers)
LONG = [("V3 / R1", "deepseek-ai/DeepSeek-V3", '{"num_hidden_layers": 1, "first_k_dense_replace": 0, "n_routed_experts": 32}', 61, 1),
        ("V3.2", "deepseek-ai/DeepSeek-V3.2", '{"num_hidden_layers": 1, "first_k_dense_replace": 0, "n_routed_experts": 32}', 61, 1),
        ("V4-Flash", "deepseek-ai/DeepSeek-V4-Flash",
         '{"num_hidden_layers": 2, "n_routed_experts": 32, "compress_ratios": [4, 128, 0], "num_hash_layers": 0}', 41, 2)]


def long(m: dict, a) -> str:
    cmds, rows = [], []
    for prompt in (4096, 16384):
        for name, repo, over, layers, measured in LONG:
            cmd = ["cpumla", "bench", repo, "--dummy-weights", "--hf-overrides", over, "-p", str(prompt), "-n", "0", "-r", "1"]
            cmds.append(cmd)
            pp = next(r for r in bench(cmd) if r["n_prompt"])
            per = pp["ttft_ms"] / 1e3 / measured
            rows.append([name, prompt, f"{per:.1f}", f"{per * layers / 60:.0f} min ({layers} layers)"])
    return ("## Long prompts\n\nTime to the first token of a long prompt, per layer of each model's real widths "
            "(one MoE layer of V3 and of V3.2; a CSA and an HCA layer of V4-Flash), and what that makes for the "
            "full model's layers of that kind. V3 attends to every earlier token (quadratic in the prompt); "
            "V3.2's indexer picks 2048 of them and V4-Flash attends to a window and compressed entries, "
            "near linear. V3.2's sparse attention runs absorbed, though (576 + 512 products a key and head, "
            "against 192 + 128 for V3's un-absorbed prefill), so on a CPU it is no faster than V3 up to about "
            "16k tokens; past that its cost grows linearly and V3's quadratically.\n\n" + stamp(m, cmds) + "\n" +
            table(["model", "prompt tokens", "TTFT s a layer", "the full model's layers"], rows, right=2) + "\n")


def kernels(m: dict, a) -> str:
    cmds = [["cpumla", "bench", "--kernels"]]
    if m["isa"] != "avx2" and "avx2" in json.loads(run(["cpumla", "info", "--json"]))["implementations_available"]:
        cmds.append(["env", "CPUMLA_ISA=avx2", "cpumla", "bench", "--kernels"])
    gemv, gemm = [], []
    for cmd in cmds:
        env = dict(e.split("=", 1) for e in cmd[1:] if "=" in e and cmd[0] == "env")
        real = cmd[len(env) + 1:] if cmd[0] == "env" else cmd
        d = json.loads(run(real + ["-o", "json"], env=env))
        for r in d["results"]:
            if r["kernel"] == "gemv":
                gemv.append([d["isa"], r["format"], r["isa"], f"{r['gbs']:.1f}", f"{r['pct_probe']:.0f}% of {r['probe_gbs']:.1f}",
                             f"{r['cache_gbs']:.1f}"])
            else:
                gemm.append([d["isa"], r["format"], r["shape"], r["isa"], f"{r['gflops']:.0f}",
                             f"{r['pct_peak']:.0f}% of {r['peak']} {r['peak_gflops']:.0f}" if r["peak"] else
                             f"none: {r['no_peak']}"])
    return ("## Kernels\n\nA GEMV of each weight format over a 10944 x 2048 weight (a V2-Lite dense layer), "
            "cycling over copies that cannot stay in cache, next to a read probe taken right before and after it; "
            "its rate over weights that stay in cache is what its instructions allow (below the probe, that "
            "format's decode is bound by the core). GEMM: 128 tokens, against the probe that bounds its arithmetic "
            "(the tiles' own bf16 or int8 peak for AMX tiles, none for int8 dot products).\n\n" + stamp(m, cmds) + "\n" +
            table(["level", "format", "served by", "GB/s", "of the read probe (GB/s)", "in cache, GB/s"], gemv, right=3) +
            "\n\n" + table(["level", "format", "shape", "served by", "GFLOP/s", "of the peak bounding it (GFLOP/s)"], gemm,
                                 right=4) + "\n")


def formats(m: dict, a) -> str:
    cmd = ["python3", "benchmarks/quant_quality.py", "--dummy-weights", "-n", "256"]
    env = {}
    if a.convert and a.llama_sdist and a.llama_lib:
        cmd += ["--llama", "--convert", a.convert] + (["--llama-no-extra-bufts"] if a.llama_no_extra_bufts else [])
        env = {"PYTHONPATH": with_path(a.llama_sdist), "LLAMA_CPP_LIB_PATH": a.llama_lib}
    tables = md_tables(run(cmd, env=env), captions=False)
    shown = {"PYTHONPATH": a.llama_sdist, "LLAMA_CPP_LIB_PATH": a.llama_lib} if env else None
    return ("## Quality of q8 and q4\n\nKL divergence of each quantization's next-token distributions from "
            "bf16's over 256 positions of the 4-layer V2-Lite-width model (dummy weights give nearly flat "
            "distributions, so KL is the figure to read, not top-1 agreement)" +
            ("; llama.cpp's types of the same weights against llama.cpp's own bf16 run" if env else "") + ".\n\n"
            + stamp(m, [cmd], shown) + "\n" + "\n\n".join(tables) + "\n")


def peers(m: dict, a) -> tuple[str, str]:
    llama = bool(a.convert and a.llama_lib)
    base = ["python3", "benchmarks/compare.py", "-p", "512", "-n", "32", "-r", "3"]
    extra = ["--convert", a.convert, "--llama-lib", a.llama_lib] if llama else []
    quantized = extra + (["--llama-no-extra-bufts"] if a.llama_no_extra_bufts else [])
    cmds = [base + extra] + ([base + ["--quant", q, "--skip-transformers"] + quantized for q in ("q8", "q4")]
                             if llama else [])
    env = {"PYTHONPATH": with_path(a.llama_sdist)} if llama and a.llama_sdist else {}
    rows = []
    for cmd in cmds:
        for t in md_tables(run(cmd, env=env)):
            body = [line for line in t.splitlines() if line.startswith("| ") and not line.startswith("| engine")]
            rows += [[c.strip() for c in line.strip("|").split("|")] for line in body]
    tab = table(["engine", "pp512 tok/s", "tg32 tok/s", "cpumla prefill x", "cpumla decode x"], rows)
    note = ("llama.cpp's quantized runs go without its extra weight buffers (AMX, repack): with them it aborts "
            "on this model's quantized files on an AMX CPU. " if llama and a.llama_no_extra_bufts else "")
    which = ""
    if llama and a.llama_sdist:
        info = Path(a.llama_sdist, "PKG-INFO")
        ver = re.search(r"^Version: (.+)$", info.read_text(), re.M) if info.exists() else None
        which = (f"llama.cpp is the tree of llama-cpp-python {ver.group(1) if ver else ''}'s sdist (`vendor/llama.cpp`), "
                 "built as shared libraries for this CPU (`cmake -B build -DBUILD_SHARED_LIBS=ON -DGGML_NATIVE=ON && "
                 "cmake --build build --target llama llama-quantize`), driven by llama-cpp-python's own Python "
                 "code. ")
    page = ("## Side by side with llama.cpp and transformers\n\nThe same weights in every engine: the 4-layer "
            "V2-Lite-width model saved as a bf16 checkpoint (vocabulary 129280, for llama.cpp's converter), "
            "converted to GGUF and quantized by llama.cpp's own tools for its rows; engines alternate run by run, "
            "median of 3. " + which + note + "\n\n" + stamp(m, cmds, {"PYTHONPATH": a.llama_sdist} if env else None)
            + "\n" + tab + "\n")
    front = (f"On {m['cpu']}, {m['threads']} threads, {m['date']} ([docs/performance.md](docs/performance.md)):"
             "\n\n" + tab)
    return page, front


# ---- the page ---------------------------------------------------------------------------------------
HEAD = """# Performance

What cpumla measures on the machine it was last run on, section by section. Every section is produced by
`benchmarks/performance.py` (it says which commands it ran), which rewrites this page; the history of
past measurements is in git. Decode figures are also shares of a read probe taken in the same run, since
a shared host's memory bandwidth drifts; peers are compared by alternating engines.
"""


def sections_of(text: str) -> dict[str, str]:
    return {m.group(1): m.group(2).strip() + "\n" for m in
            re.finditer(r"<!-- section: (\w+) -->\n(.*?)<!-- /section -->", text, re.S)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated: {', '.join(SECTIONS)}")
    ap.add_argument("--llama-lib", default=None, help="directory of llama.cpp's libllama.so (a shared build)")
    ap.add_argument("--llama-sdist", default=None, help="llama-cpp-python's unpacked sdist (its Python code)")
    ap.add_argument("--convert", default=None, help="llama.cpp's convert_hf_to_gguf.py")
    ap.add_argument("--llama-no-extra-bufts", action="store_true",
                    help="llama.cpp's quantized runs without its AMX / repack buffers (see compare.py)")
    ap.add_argument("--out", default=str(PAGE))
    a = ap.parse_args()
    want = [s.strip() for s in a.sections.split(",") if s.strip()]
    bad = [s for s in want if s not in SECTIONS]
    if bad:
        raise SystemExit(f"performance.py: unknown section '{bad[0]}' (sections: {', '.join(SECTIONS)})")
    out = Path(a.out)
    have = sections_of(out.read_text()) if out.exists() else {}
    if a.convert:
        SHOWN[a.convert] = "<llama.cpp>/convert_hf_to_gguf.py"
    if a.llama_lib:
        SHOWN[a.llama_lib] = "<llama.cpp build>/bin"
    if a.llama_sdist:
        SHOWN[a.llama_sdist] = "<llama-cpp-python sdist>"
    m = machine()
    front = None
    for name in want:
        if name == "peers":
            have[name], front = peers(m, a)
        else:
            have[name] = globals()[name](m, a)
        text = HEAD + "".join(f"\n<!-- section: {s} -->\n{have[s]}<!-- /section -->\n" for s in SECTIONS if s in have)
        out.write_text(text)               # after each section: a long run that stops keeps what it measured
    if front is not None and out.resolve() == PAGE.resolve():
        readme = README.read_text()
        new = re.sub(r"(<!-- performance -->\n).*?(<!-- /performance -->)",
                     lambda mm: mm.group(1) + front + "\n" + mm.group(2), readme, flags=re.S)
        README.write_text(new)


if __name__ == "__main__":
    main()
