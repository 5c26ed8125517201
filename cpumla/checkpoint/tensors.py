"""A family's tensors as the kernels take them: a checkpoint tensor (or a dummy one) -> a native
Weight or a vector, with its shape and format checked and its scale grid paired with it.

A source is anything with `has(name)`, `info(name) -> (dtype, shape)` and `tensor(name) -> ndarray`:
a real checkpoint (checkpoint/safetensors.py, memory-mapped, zero copy) or DummySource (dummy.py:
deterministic random tensors in the formats a real checkpoint has). Which tensors a model reads (and
so which it never reads, such as an MTP layer) is its family module's business (cpumla/models).
"""

from __future__ import annotations

import numpy as np

from cpumla import native
from cpumla.checkpoint.formats import FORMAT_OF, QSCALE
from cpumla.errors import CpumlaError

# GGUF block types (checkpoint/gguf.py) -> the native weight format (native.GGUF_FORMATS)
GGUF_TYPES = {t: t.lower() for t in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
                                     "IQ4_NL", "IQ4_XS", "IQ2_XXS", "IQ3_XXS", "IQ1_S", "IQ1_M", "MXFP4")}


def where(src, name: str | None = None) -> str:
    """Where a tensor lives, for messages: its shard file, else the file that would hold it (a GGUF
    model's MTP file for its MTP layer's), else the checkpoint directory."""
    if name is not None and hasattr(src, "file_of") and src.has(name):
        return str(src.file_of(name))
    if name is not None and hasattr(src, "home_of"):
        return str(src.home_of(name))
    d = getattr(src, "directory", None)
    return str(d) if d is not None else "dummy weights"


def label(src, name: str) -> str:
    """A tensor's name as its file has it, for messages (a GGUF file's own names)."""
    return src.label(name) if hasattr(src, "label") else name


def checked_dtype(src, name: str, shape) -> str:
    """The dtype of tensor `name` after checking it exists with `shape`."""
    if not src.has(name):
        raise CpumlaError(f"{where(src, name)}: checkpoint is missing tensor '{label(src, name)}'")
    dtype, got = src.info(name)
    if tuple(got) != tuple(shape):
        raise CpumlaError(f"{where(src, name)}: tensor '{label(src, name)}' has shape {list(got)}, config wants "
                          f"{list(shape)}")
    return dtype


def linear(src, name: str, shape: tuple[int, int], block: tuple[int, int] = (128, 128)) -> native.Weight:
    """A [out, in] weight in its checkpoint format (FP8 with its `weight_scale_inv` block grid; q8 / q4
    with its `_qscale` grid), quantized to q8 / q4 when the source carries a Quantizer that asks for it
    (`src.quantizer`, set by cpumla.load(..., quant=))."""
    if src.has(name) and src.info(name)[0] in GGUF_TYPES:
        w = gguf_block(src, name, shape)
    elif src.has(name) and src.info(name)[0] in ("I8", "U8"):
        w = stored_quantized(src, name, shape)
    else:
        w = stored_linear(src, name, shape, block)
    qz = getattr(src, "quantizer", None)
    return qz(name, w) if qz is not None else w


def gguf_block(src, name: str, shape: tuple[int, int]) -> native.Weight:
    """A GGUF tensor of a block format (Q8_0, Q4_K, IQ2_XXS ...), read in place: its raw blocks [rows, row bytes]."""
    dtype = checked_dtype(src, name, shape)
    return native.Weight(src.tensor(name), GGUF_TYPES[dtype])


def embedding(src, name: str, shape: tuple[int, int]) -> native.Weight:
    """An embedding table as the forward reads it (a row dequantized per token): F32 / BF16 / F16 as
    `vector`, or a GGUF block format (Q8_0)."""
    if src.has(name) and src.info(name)[0] in GGUF_TYPES:
        return gguf_block(src, name, shape)
    v = vector(src, name, shape)
    return native.Weight(v, native.format_of(v))


def table(src, name: str, shape: tuple[int, int]) -> np.ndarray:
    """A small 2-D table the forward reads as numbers (V4's compressors' position biases): as `vector`, or
    dequantized to float32 from a GGUF block format (llama-quantize gives one to every 2-D tensor whose rows
    hold whole blocks, these too)."""
    if src.has(name) and src.info(name)[0] in GGUF_TYPES:
        return native.dequant(gguf_block(src, name, shape))
    return vector(src, name, shape)


def stored_quantized(src, name: str, shape: tuple[int, int]) -> native.Weight:
    """A q8 (I8 [out, in]) or q4 (U8 [out, in/2]) tensor of a cpumla checkpoint with its F16 scale grid."""
    dtype, got = src.info(name)
    fmt = "q8" if dtype == "I8" else "q4"
    want = (shape[0], shape[1] if fmt == "q8" else shape[1] // 2)
    if tuple(got) != want or shape[1] % native.QBLOCK:
        raise CpumlaError(f"{where(src, name)}: {fmt} tensor '{name}' has shape {list(got)}, config wants {list(want)}")
    sname = name + QSCALE
    if not src.has(sname):
        raise CpumlaError(f"{where(src, name)}: {dtype} tensor '{name}' has no scale tensor '{sname}' "
                          f"(a {fmt} checkpoint with a tensor missing)")
    sdtype, sshape = src.info(sname)
    grid = (shape[0], shape[1] // native.QBLOCK)
    if sdtype != "F16" or tuple(sshape) != grid:
        raise CpumlaError(f"{where(src, sname)}: '{sname}' is {sdtype} {list(sshape)}, want F16 {list(grid)} "
                          f"(one scale per {native.QBLOCK} values)")
    data = src.tensor(name)
    return native.Weight(data.view(np.int8) if fmt == "q8" else data, fmt, src.tensor(sname).view(np.float16))


def stored_linear(src, name: str, shape: tuple[int, int], block: tuple[int, int] = (128, 128)) -> native.Weight:
    """A [out, in] weight as stored: f32 / bf16 / f16, or FP8 with its `weight_scale_inv` block grid."""
    dtype = checked_dtype(src, name, shape)
    fmt = FORMAT_OF.get(dtype)
    if fmt is None:
        raise CpumlaError(f"{where(src, name)}: tensor '{label(src, name)}' has dtype {dtype}, which cpumla cannot use "
                          f"for a weight")
    data = src.tensor(name)
    if fmt != "e4m3":
        return native.Weight(data, fmt)
    sname = name + "_scale_inv"
    if not src.has(sname):
        raise CpumlaError(f"{where(src, name)}: FP8 tensor '{name}' has no '{sname}'")
    scale = src.tensor(sname)
    if scale.dtype != np.float32 and scale.dtype != np.uint8:
        raise CpumlaError(f"{where(src, sname)}: '{sname}' must be F32 or F8_E8M0")
    return native.Weight(data, "e4m3", scale, block)


def vector(src, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """A norm weight, bias or embedding table: float32, bf16 bits (uint16) or float16, as stored."""
    dtype = checked_dtype(src, name, shape)
    if dtype not in ("F32", "BF16", "F16"):
        raise CpumlaError(f"{where(src, name)}: tensor '{label(src, name)}' has dtype {dtype}; cpumla reads it as F32, "
                          f"BF16 or F16 only")
    return src.tensor(name)


def as_f32(v: np.ndarray) -> np.ndarray:
    if v.dtype == np.uint16:
        return (v.astype(np.uint32) << 16).view(np.float32)
    return v.astype(np.float32)
