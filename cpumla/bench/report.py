"""`cpumla bench --kernels --report`: what a user sends to report a wrong result or a slow path.

Every level this machine runs is checked against the scalar spec on this machine: the linear algebra
(gemv, gemm with few and many tokens: the many-token one reaches AMX tiles and the vdpbf16ps panels,
the absorb gemv_t, dequant) in every weight format, FP8 / FP4 with random, all-subnormal and all-zero
codes, and the row kernels (rmsnorm, softmax, swiglu). A result is wrong when it is further from the
spec than fp32 summation allows: |got - spec| > 1e-5 * sum |terms| (the terms taken from the spec's
dequantised weight in float64). Then the GEMV weight operands every level multiplies
(cpumla_decode_operands): a subnormal one would take a microcode assist on Intel cores.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from cpumla import native
from cpumla.bench import kernels as kb
from cpumla.errors import CpumlaError

RTOL = 1e-5


@dataclass
class Check:
    isa: str
    kernel: str
    format: str
    codes: str
    worst: float             # largest |got - spec| / bound (<= 1: within fp32 summation)
    ok: bool
    impl: str                # what served it (cpumla_kernel_impl)


def _weights(rng: np.random.Generator):
    """(format label, codes, weight) of every format and code distribution"""
    for fmt in kb.FORMATS:
        for codes in kb.CODES if fmt in kb.QUANTISED else ("",):
            yield fmt, codes, kb.random_weight(fmt, 67, 320, rng, codes or "random")


def _bound(w_spec: np.ndarray, x: np.ndarray) -> np.ndarray:
    return RTOL * (np.abs(x.astype(np.float64)) @ np.abs(w_spec).T) + 1e-30


def _worst(got, want, bound) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if not np.array_equal(np.isnan(got), np.isnan(want)):
        return float("inf")
    ok = ~np.isnan(want)
    return float((np.abs(got - want)[ok] / bound[ok]).max(initial=0.0))


def _linear(w, x1, xn, xm, xt):
    rows = w.rows
    return {
        "gemv": native.gemv(w, x1),
        "gemm": native.gemm(w, xn),
        "gemm_many": native.gemm(w, xm),
        "head_gemv_t": native.head_gemv_t(w, 0, rows, rows, xt[None, None, :])[0, 0],
        "dequant": native.dequant(w),
    }


def _rows(x, g):
    return {"rmsnorm": native.rmsnorm(x, g, 1e-6), "softmax": native.softmax(x.copy()),
            "swiglu": native.swiglu(x, g[None, :].repeat(len(x), 0).astype(np.float32), 7.0)}


def checks(seed: int = 0) -> list[Check]:
    rng = np.random.default_rng(seed)
    cases = list(_weights(rng))
    x1 = rng.standard_normal(320).astype(np.float32)
    xn = rng.standard_normal((5, 320)).astype(np.float32)
    xm = rng.standard_normal((40, 320)).astype(np.float32)
    xt = rng.standard_normal(67).astype(np.float32)
    xr, g = rng.standard_normal((9, 300)).astype(np.float32), rng.standard_normal(300).astype(np.float32)
    before = native.isa()
    out: list[Check] = []
    try:
        native.init("scalar")
        spec = [(_linear(w, x1, xn, xm, xt), native.dequant(w).astype(np.float64)) for _, _, w in cases]
        spec_rows = _rows(xr, g)
        for isa in native.available_isas():
            if isa == "scalar":
                continue
            native.init(isa)
            for (fmt, codes, w), (want, wd) in zip(cases, spec):
                got = _linear(w, x1, xn, xm, xt)
                bounds = {"gemv": _bound(wd, x1), "gemm": _bound(wd, xn), "gemm_many": _bound(wd, xm),
                          "head_gemv_t": RTOL * (np.abs(xt.astype(np.float64)) @ np.abs(wd)) + 1e-30,
                          "dequant": np.full(wd.shape, 1e-30)}
                for k in got:
                    worst = _worst(got[k], want[k], bounds[k])
                    impl = native.kernel_impl(("gemm" if k == "gemm_many" else k) + ":" + fmt.split("-")[0])
                    out.append(Check(isa, k, fmt, codes, worst, worst <= 1.0, impl))
            got_rows = _rows(xr, g)
            for k, v in got_rows.items():
                bound = RTOL * np.maximum(np.abs(spec_rows[k]), 1e-3) + 1e-30
                worst = _worst(v, spec_rows[k], bound)
                out.append(Check(isa, k, "", "", worst, worst <= 1.0, native.kernel_impl(k)))
    finally:
        native.init(before)
    return out


def operands() -> list[dict]:
    """Per level and format: how many codes decode to a subnormal operand, and to a wrong value."""
    rows = []
    for isa in native.available_isas():
        for fmt in ("e4m3",):             # e2m1's products multiply integers (kernels.h)
            try:
                got, k = native.decode_operands(isa, fmt)
            except CpumlaError:
                continue
            spec, _ = native.decode_operands("scalar", fmt)
            g = got.astype(np.float64)
            sub = int(((g != 0) & (np.abs(g) < np.finfo(np.float32).tiny)).sum())
            wrong = int((~np.isnan(spec) & (np.ldexp(g, k) != spec)).sum())
            rows.append({"isa": isa, "format": fmt, "subnormal_operands": sub, "wrong_values": wrong})
    return rows


def as_dicts(cs: list[Check]) -> list[dict]:
    return [asdict(c) for c in cs]
