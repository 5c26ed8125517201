"""Build and run benchmarks/gqp_replica.c: the GGUF panels' inner loop alone, cycles per row's chunk.

The C file says what each line measures. Needs gcc and a CPU with AVX-512 VNNI; builds into a
temporary folder, nothing is written next to the checkout.

    python3 benchmarks/gqp_replica.py [--cc gcc]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

FLAGS = ["-O3", "-std=gnu11", "-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq",
         "-mavx512vnni", "-ffp-contract=off"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cc", default="gcc", help="the C compiler (default gcc)")
    args = ap.parse_args()
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    if "avx512_vnni" not in flags:
        print("gqp_replica: this CPU has no AVX-512 VNNI", file=sys.stderr)
        return 2
    src = Path(__file__).with_name("gqp_replica.c")
    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / "gqp_replica"
        subprocess.run([args.cc, *FLAGS, str(src), "-o", str(exe)], check=True)
        return subprocess.run([str(exe)]).returncode


if __name__ == "__main__":
    sys.exit(main())
