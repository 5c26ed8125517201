"""The x86 levels' own products for the 32-column types, the IQ types and MXFP4 (gqi_x86.h), bit for bit the
scalar spec's on every level: row counts that leave 1..3 rows past a group of four, 1..20 tokens, rows of
32-column types whose block count is not a multiple of 8, extreme codes, sub-scales and activations, rows
strided in a stacked tensor."""

from __future__ import annotations

import numpy as np
import pytest

from cpumla import native

pytest.importorskip("gguf")
from test_gguf_types import blocks  # noqa: E402

TYPES = ["q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl", "mxfp4", "iq4_xs", "iq2_xxs", "iq3_xxs", "iq1_s", "iq1_m"]


def spec(w, x):
    native.init("scalar")
    try:
        return native.gemm(w, x)
    finally:
        native.init("")


def check(isa, w, x):
    native.init(isa)
    y = native.gemm(w, x)
    for t in (0, x.shape[0] - 1):
        assert np.array_equal(native.gemv(w, x[t]).view(np.uint32), y[t].view(np.uint32))
    want = spec(w, x)
    native.init(isa)
    assert np.array_equal(y.view(np.uint32), want.view(np.uint32)), f"{isa}: max diff {np.max(np.abs(y - want))}"


@pytest.mark.parametrize("fmt", TYPES)
def test_rows_tokens_tails(isa, fmt):
    block = native.GGUF_FORMATS[fmt][0]
    shapes = [(1, 256), (7, 512), (6, 768)] if block == 256 else [(1, 32), (5, 224), (6, 256), (3, 288), (9, 1408)]
    rng = np.random.default_rng(len(fmt))
    for i, (rows, cols) in enumerate(shapes):
        w = native.Weight(blocks(fmt, rows, cols, seed=100 + i), fmt)
        for n in (1, 2, 3, 5, 20, 37):
            check(isa, w, rng.standard_normal((n, cols)).astype(np.float32))


@pytest.mark.parametrize("fmt", TYPES)
def test_extreme_codes_and_activations(isa, fmt):
    """Blocks of all-ones and all-zero bytes (largest codes, scales and grid indices; every sign set / clear)
    against activations at full scale of one sign, of alternating signs and zero."""
    block, per = native.GGUF_FORMATS[fmt][0], native.GGUF_FORMATS[fmt][1]
    cols = 512 if block == 256 else 288
    raw = blocks(fmt, 8, cols, seed=5)
    keep = raw.reshape(8, cols // block, per).copy()
    b = raw.reshape(8, cols // block, per)
    b[0:2] = 0xFF
    b[2:4] = 0x00
    b[4] = np.where(np.arange(per) % 2 == 0, 0xFF, 0x00).astype(np.uint8)
    for r in range(5):                                   # scale fields kept finite
        for at in {"q4_0": (0,), "q4_1": (0, 2), "q5_0": (0,), "q5_1": (0, 2), "iq4_nl": (0,), "iq4_xs": (0,),
                   "iq2_xxs": (0,), "iq3_xxs": (0,), "iq1_s": (0,)}.get(fmt, ()):
            b[r, :, at:at + 2] = keep[r, :, at:at + 2]
    if fmt == "mxfp4":
        b[0:5, :, 0] = 127
    w = native.Weight(raw, fmt)
    x = np.stack([np.full(cols, 3.0), np.full(cols, -3.0), np.where(np.arange(cols) % 2, 1.0, -1.0),
                  np.zeros(cols), np.random.default_rng(1).standard_normal(cols) * 1e4]).astype(np.float32)
    for isa_x in (x, x[:1], x[1:2], np.tile(x, (4, 1))):     # 20 tokens: the panels (avx512vnni_gqp.c) too
        check(isa, w, isa_x)


@pytest.mark.parametrize("fmt", ["q5_0", "iq2_xxs", "iq1_m", "mxfp4"])
def test_strided_rows(isa, fmt):
    block = native.GGUF_FORMATS[fmt][0]
    cols = 512 if block == 256 else 352
    raw = blocks(fmt, 3 * 10, cols, seed=9).reshape(3, 10, -1)
    view = raw[2][1::2]
    x = np.random.default_rng(2).standard_normal((3, cols)).astype(np.float32)
    check(isa, native.Weight(view, fmt), x)
    native.init(isa)
    assert np.array_equal(native.gemm(native.Weight(view, fmt), x),
                          native.gemm(native.Weight(np.ascontiguousarray(view), fmt), x))
    native.init("")


@pytest.mark.parametrize("fmt", TYPES)
def test_served_by_the_level(isa, fmt):
    native.init(isa)
    if isa in ("avx2", "avx512vnni", "avx512", "amx"):
        want = "avx2" if isa == "avx2" else "avx512vnni"
        assert native.kernel_impl(f"gemv:{fmt}") == want
        gemm = native.kernel_impl(f"gemm:{fmt}")       # amx: its tiles from some tokens on (amx_gq.c), else want
        assert gemm == want if isa != "amx" else gemm.startswith(f"amx ({want} below "), gemm
