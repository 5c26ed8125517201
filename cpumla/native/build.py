"""Build of the kernel library: each C file under csrc/ compiled with its own flags (csrc/FLAGS),
linked into one cffi extension in API mode (out-of-line).

Why API mode rather than a dlopen'ed library in ABI mode: calls go straight from the generated
C wrapper to our functions (no libffi marshalling per call, which matters for decode's many small
calls), and a mismatch between the header and the library is a compile error instead of a crash.
The per-ISA objects are compiled here and handed to the extension as extra objects, so the one
`pip install` builds everything.

Layout of csrc/: include/ the public headers (cffi's cdef and the wrapper read these alone), core/ the
runtime, kernels/<arch>/ one file prefix per instruction-set level, kernels/generic/ bodies compiled
once per level, models/ one file per model family. Every file is compiled with -I csrc/include
-I csrc: public headers are included by name, internal ones by their path from csrc/.
"""

from __future__ import annotations

import os
import platform
import shlex
import subprocess
import sysconfig
from pathlib import Path

from cffi import FFI

CSRC = Path(__file__).resolve().parent / "csrc"
INCLUDE = CSRC / "include"


def machine() -> str:
    m = platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(m, m)


def read_flags(path: Path = CSRC / "FLAGS") -> tuple[list[str], list[tuple[str, str, list[str]]]]:
    """(common flags, [(file, arch, flags)]) from csrc/FLAGS; file is a path relative to csrc/."""
    common: list[str] = []
    files: list[tuple[str, str, list[str]]] = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = shlex.split(line)
        if parts[0] == "COMMON":
            common = parts[1:]
        else:
            files.append((parts[0], parts[1], parts[2:]))
    return common, files


def sources_for(arch: str) -> list[tuple[str, list[str]]]:
    _, files = read_flags()
    return [(f, flags) for f, a, flags in files if a in ("any", arch)]


def source_files() -> list[Path]:
    """Every file under csrc/ (sources, headers, FLAGS): what the extension depends on."""
    return sorted(p for p in CSRC.rglob("*") if p.is_file())


def compile_objects(out_dir: Path, cc: str | None = None, arch: str | None = None) -> list[str]:
    """Compile every library source for this architecture into out_dir, each object at its source's
    path relative to csrc/ (so two folders may hold the same file name); returns the object paths."""
    cc = cc or os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    arch = arch or machine()
    common, _ = read_flags()
    version = package_version()
    out_dir.mkdir(parents=True, exist_ok=True)
    objs = []
    for name, flags in sources_for(arch):
        src = CSRC / name
        obj = (out_dir / name).with_suffix(".o")
        obj.parent.mkdir(parents=True, exist_ok=True)
        record = " ".join(common + flags)
        cmd = shlex.split(cc) + common + flags + [
            f"-DCPUMLA_FLAGS=\"{record}\"",
            f"-DCPUMLA_VERSION=\"{version}\"",
            "-I", str(INCLUDE), "-I", str(CSRC), "-c", str(src), "-o", str(obj),
        ]
        subprocess.run(cmd, check=True)
        objs.append(str(obj))
    return objs


def package_version() -> str:
    text = (CSRC.parent.parent / "__init__.py").read_text()
    for line in text.splitlines():
        if line.startswith("__version__"):
            return line.split("=")[1].strip().strip("\"'")
    return "0"


# The public headers (csrc/include/), in dependency order: the core kernels, then one per model family.
PUBLIC_HEADERS = ("cpumla.h", "mla_attention.h", "deepseek_v2.h", "deepseek_v32.h", "deepseek_v4.h")


def cdef_text() -> str:
    """The public headers without preprocessor lines and the extern "C" braces, for cffi's cdef."""
    keep = []
    for header in PUBLIC_HEADERS:
        for line in (INCLUDE / header).read_text().splitlines():
            s = line.strip()
            if s.startswith("#") or s in ('extern "C" {', "}") and s != "};":
                continue
            keep.append(line)
    return "\n".join(keep)


ffibuilder = FFI()
ffibuilder.cdef(cdef_text())
ffibuilder.set_source(
    "cpumla.native._cpumla",
    "\n".join(f'#include "{h}"' for h in PUBLIC_HEADERS),
    include_dirs=[str(INCLUDE)],
    libraries=["m", "pthread"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
