"""The kernel library itself (cffi, API mode): loading it, its errors, the implementation it runs,
threads, and what it reports about the CPU and the build.

The implementation is chosen on first use: the best this CPU and OS run, or the one named by the
environment variable CPUMLA_ISA (scalar, avx2, avxvnni, avx512f, avx512vnni, avx512, amx, neon).
Asking for one that is not there is a CpumlaError, never a crash. CPUMLA_PREFETCH (l1, l2, l2+l1, auto) overrides where the GEMVs prefetch
their weights (gemv_prefetch(); the CPU's own choice by default).
"""

from __future__ import annotations

import os

import numpy as np

from cpumla.errors import CpumlaError
from cpumla.native import checks

try:
    from cpumla.native._cpumla import ffi, lib
except ImportError as e:  # pragma: no cover - only without a build
    raise CpumlaError(
        f"cpumla's kernel library is not built ({e}); install with `pip install .` or `make`"
    ) from None

ISAS = ("scalar", "avx2", "avxvnni", "avx512f", "avx512vnni", "avx512", "amx", "neon")
KERNELS = tuple(ffi.string(lib.cpumla_kernel_names()).decode().split())
DTYPES = {"f32": lib.CPUMLA_F32, "bf16": lib.CPUMLA_BF16, "f16": lib.CPUMLA_F16,
          "e4m3": lib.CPUMLA_E4M3, "e2m1": lib.CPUMLA_E2M1, "q8": lib.CPUMLA_Q8, "q4": lib.CPUMLA_Q4,
          "q8_0": lib.CPUMLA_Q8_0, "q4_0": lib.CPUMLA_Q4_0, "q4_1": lib.CPUMLA_Q4_1, "q5_0": lib.CPUMLA_Q5_0,
          "q5_1": lib.CPUMLA_Q5_1, "q2_k": lib.CPUMLA_Q2_K, "q3_k": lib.CPUMLA_Q3_K, "q4_k": lib.CPUMLA_Q4_K,
          "q5_k": lib.CPUMLA_Q5_K, "q6_k": lib.CPUMLA_Q6_K, "iq4_nl": lib.CPUMLA_IQ4_NL, "iq4_xs": lib.CPUMLA_IQ4_XS,
          "iq2_xxs": lib.CPUMLA_IQ2_XXS, "iq3_xxs": lib.CPUMLA_IQ3_XXS, "iq1_s": lib.CPUMLA_IQ1_S,
          "iq1_m": lib.CPUMLA_IQ1_M, "mxfp4": lib.CPUMLA_MXFP4}
# GGUF's block formats read in place (cpumla.h, gguf_q.h): (columns, bytes) of a block
GGUF_FORMATS = {"q8_0": (32, 34), "q4_0": (32, 18), "q4_1": (32, 20), "q5_0": (32, 22), "q5_1": (32, 24),
                "q2_k": (256, 84), "q3_k": (256, 110), "q4_k": (256, 144), "q5_k": (256, 176), "q6_k": (256, 210),
                "iq4_nl": (32, 18), "iq4_xs": (256, 136), "iq2_xxs": (256, 66), "iq3_xxs": (256, 98),
                "iq1_s": (256, 50), "iq1_m": (256, 56), "mxfp4": (32, 17)}
QUANT_FORMATS = ("q8", "q4")     # cpumla's own block formats (cpumla.h): made by quantize()
QBLOCK = 32
_STATE = {"isa": None}


def last_error() -> str:
    """The library's message for the calling thread's last failure."""
    return ffi.string(lib.cpumla_last_error()).decode()


def check(rc: int) -> None:
    """Raises CpumlaError with the library's message (this thread's) when a kernel returned -1."""
    if rc != 0:
        raise CpumlaError(last_error() or "cpumla kernel failed")



def init(isa: str | None = None) -> str:
    """Choose the implementation (None: $CPUMLA_ISA, else the best available). Returns its name."""
    if isa is None:
        isa = os.environ.get("CPUMLA_ISA", "").strip()
    if lib.cpumla_init(isa.encode()) != 0:
        source = " (from CPUMLA_ISA)" if isa and isa == os.environ.get("CPUMLA_ISA", "").strip() else ""
        raise CpumlaError(last_error() + source)
    _STATE["isa"] = ffi.string(lib.cpumla_isa()).decode()
    if not _STATE.get("tables"):
        gguf_tables()
        _STATE["tables"] = True
    where = os.environ.get("CPUMLA_PREFETCH", "").strip()
    if where and lib.cpumla_set_gemv_prefetch(where.encode()) != 0:
        raise CpumlaError(last_error() + " (from CPUMLA_PREFETCH)")
    return _STATE["isa"]


def gguf_tables() -> None:
    """Hands the IQ types' codebooks and the IQ4 / MXFP4 value tables to the library, from the gguf
    package (the format's own library): cpumla_gguf_tables."""
    import numpy as np
    from gguf import quants

    def grid(cls, dtype):
        cls.init_grid()
        return np.ascontiguousarray(cls.grid.reshape(-1), dtype=np.float32).astype(dtype)

    tables = [grid(quants.IQ2_XXS, np.uint8), grid(quants.IQ3_XXS, np.uint8), grid(quants.IQ1_S, np.int8),
              np.frombuffer(quants.IQ2_XXS.ksigns, dtype=np.uint8).copy(),
              np.array(quants.IQ4_NL.kvalues, np.int8), np.array(quants.MXFP4.kvalues, np.int8)]
    sizes = (256 * 8, 256 * 4, 2048 * 8, 128, 16, 16)
    if [t.size for t in tables] != list(sizes):
        raise CpumlaError(f"the gguf package's IQ tables have sizes {[t.size for t in tables]}, not {list(sizes)}")
    types = ("uint8_t *", "uint8_t *", "int8_t *", "uint8_t *", "int8_t *", "int8_t *")
    check(lib.cpumla_gguf_tables(*(ffi.cast(c, t.ctypes.data) for c, t in zip(types, tables))))


def set_gemv_prefetch(where: str) -> None:
    """Where the GEMVs prefetch their weight rows: "l1", "l2", "l2+l1" (into L2, and again nearer into
    L1) for every stream, or "auto" (this CPU's own, as cpumla_init picks it: the AVX-512 integer and
    e4m3 loops and the others apart). Results are the same bits either way."""
    check(lib.cpumla_set_gemv_prefetch(where.encode()))


def gemv_prefetch() -> str:
    """"l1", "l2" or "l2+l1", and why in parentheses (cpumla.h cpumla_gemv_prefetch)."""
    ensure_init()
    return ffi.string(lib.cpumla_gemv_prefetch()).decode()


def ensure_init() -> str:
    return _STATE["isa"] or init()


def isa() -> str:
    return ensure_init()


def built_isas() -> list[str]:
    return ffi.string(lib.cpumla_isa_list()).decode().split()


def available_isas() -> list[str]:
    """Implementations built in that this CPU and OS can run, lowest first."""
    return [i for i in built_isas() if lib.cpumla_isa_available(i.encode())]


MAX_THREADS = 256      # the pool's size: CPUMLA_MAX_THREADS in the library's thread pool


def set_threads(n: int | None) -> int:
    """n threads (None or 0: one per online core); more than MAX_THREADS is a CpumlaError, never a
    silent cap. Returns the count now running."""
    ensure_init()
    n = 0 if n is None else checks.integer(n, "threads", 0, MAX_THREADS)
    return lib.cpumla_set_threads(n)


def get_threads() -> int:
    ensure_init()
    return lib.cpumla_get_threads()


FORMAT_KERNELS = ("gemv", "gemm", "head_gemv", "head_gemv_t", "dequant")


def kernel_impl(name: str) -> str:
    """The implementation serving a kernel ("gemv"), or one weight format of it ("gemv:e2m1")."""
    ensure_init()
    p = lib.cpumla_kernel_impl(name.encode())
    if p == ffi.NULL:
        raise CpumlaError(f"unknown kernel '{name}'")
    return ffi.string(p).decode()


def kernel_formats() -> dict[str, dict[str, str]]:
    """{kernel: {weight format: implementation that really serves it}} for the linear algebra."""
    return {k: {f: kernel_impl(f"{k}:{f}") for f in DTYPES} for k in FORMAT_KERNELS}


def cpu_features() -> dict[str, bool]:
    bits = lib.cpumla_cpu_features()
    out = {}
    for name in dir(lib):
        if name.startswith("CPUMLA_FEAT_"):
            out[name[len("CPUMLA_FEAT_"):].lower()] = bool(bits & getattr(lib, name))
    return out


def cpu_name() -> str:
    return ffi.string(lib.cpumla_cpu_name()).decode().strip()


def build_info() -> str:
    return ffi.string(lib.cpumla_build_info()).decode()


def isa_for_features(features: dict[str, bool] | int) -> str:
    """The implementation the dispatcher picks for a CPU with these features (cpu_features() names,
    or CPUMLA_FEAT_* bits): the rule itself, for CPUs other than this one."""
    if isinstance(features, dict):
        bits = 0
        for name, on in features.items():
            if on:
                bits |= getattr(lib, "CPUMLA_FEAT_" + name.upper())
        features = bits
    return ffi.string(lib.cpumla_isa_for_features(features)).decode()


def decode_operands(isa: str, fmt: str) -> tuple[np.ndarray, int]:
    """(operand of every code, k): the weight operands an implementation's GEMV loop multiplies for each
    code of fmt ("e4m3": 256 codes), with operand * 2^k = the code's value. ("e2m1" has none: its
    products multiply integers, kernels.h.)"""
    out = np.zeros(256, np.float32)
    k = lib.cpumla_decode_operands(f"{isa}:{fmt}".encode(), fptr(out))
    if k < 0:
        raise CpumlaError(f"no decode probe for {isa}:{fmt} on this machine")
    return out[: 256 if fmt == "e4m3" else 16], k




def fptr(a: np.ndarray):
    """a's data as a float * (a must be float32 and outlive the pointer)."""
    return ffi.cast("float *", a.ctypes.data)


def vptr(a: np.ndarray, ctype: str = "void *"):
    """a's data as a pointer of ctype (a must outlive the pointer)."""
    return ffi.cast(ctype, a.ctypes.data)
