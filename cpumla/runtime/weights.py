"""Weight formats shared by every family: tensors as shipped -> kernel weights, and dummy weights.

A source is anything with `has(name)`, `info(name) -> (dtype, shape)` and `tensor(name) -> ndarray`:
a real checkpoint (runtime/safetensors.py, memory-mapped, zero copy) or DummySource (deterministic
random tensors in the same formats a real checkpoint has). FP8 scales are paired with their weights
here; which tensors a model reads (and so which it never reads, such as an MTP layer) is its family
module's business (cpumla/models).
"""

from __future__ import annotations

import mmap
import zlib

import numpy as np

from cpumla import native
from cpumla.errors import CpumlaError

DUMMY_DTYPES = ("bf16", "fp8", "f32")     # --dummy-dtype: bf16 as V2 ships, FP8 block-scaled as V3, fp32
FORMAT_OF = {"F32": "f32", "BF16": "bf16", "F16": "f16", "F8_E4M3": "e4m3"}
QUANTS = native.QUANT_FORMATS              # --quant: cpumla's q8 / q4 (cpumla.h)
QSCALE = "_qscale"                         # tensor X of a q8 / q4 checkpoint has its F16 scales in X + QSCALE
Q_DTYPE = {"q8": "I8", "q4": "U8"}         # how a q8 / q4 tensor is stored in safetensors


def where(src, name: str | None = None) -> str:
    """Where a tensor lives, for messages: its shard file, else the checkpoint directory."""
    if name is not None and hasattr(src, "file_of") and src.has(name):
        return str(src.file_of(name))
    d = getattr(src, "directory", None)
    return str(d) if d is not None else "dummy weights"


def _checked(src, name: str, shape) -> str:
    """The dtype of tensor `name` after checking it exists with `shape`."""
    if not src.has(name):
        raise CpumlaError(f"{where(src)}: checkpoint is missing tensor '{name}'")
    dtype, got = src.info(name)
    if tuple(got) != tuple(shape):
        raise CpumlaError(f"{where(src, name)}: tensor '{name}' has shape {list(got)}, config wants {list(shape)}")
    return dtype


def linear(src, name: str, shape: tuple[int, int], block: tuple[int, int] = (128, 128)) -> native.Weight:
    """A [out, in] weight in its checkpoint format (FP8 with its `weight_scale_inv` block grid; q8 / q4
    with its `_qscale` grid), quantized to q8 / q4 when the source carries a Quantizer that asks for it
    (`src.quantizer`, set by cpumla.load(..., quant=))."""
    if src.has(name) and src.info(name)[0] in ("I8", "U8"):
        w = stored_quantized(src, name, shape)
    else:
        w = stored_linear(src, name, shape, block)
    qz = getattr(src, "quantizer", None)
    return qz(name, w) if qz is not None else w


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
    dtype = _checked(src, name, shape)
    fmt = FORMAT_OF.get(dtype)
    if fmt is None:
        raise CpumlaError(f"{where(src, name)}: tensor '{name}' has dtype {dtype}, which cpumla cannot use for a weight")
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


# ---- quantize on load ------------------------------------------------------------------------------
QUANT_VERSION = 1         # the layout of a checkpoint `cpumla quantize` writes (docs/quantization.md)


def check_quant_config(qc, source: str) -> None:
    """config.json's quantization_config: none, FP8 block (as DeepSeek ships), or cpumla's q8 / q4."""
    if not qc:
        return
    if not isinstance(qc, dict):
        raise CpumlaError(f"{source}: quantization_config must be an object")
    method = qc.get("quant_method")
    if method in (None, "fp8"):
        return
    if method != "cpumla":
        raise CpumlaError(f"{source}: quantization '{method}' is not supported (fp8 block, or cpumla's q8 / q4)")
    if qc.get("format_version") != QUANT_VERSION:
        raise CpumlaError(f"{source}: cpumla quantization format_version {qc.get('format_version')!r} is not one this "
                          f"cpumla reads ({QUANT_VERSION})")
    if qc.get("format") not in QUANTS or qc.get("group_size") != native.QBLOCK:
        raise CpumlaError(f"{source}: cpumla quantization wants format q8 or q4 with group_size {native.QBLOCK}, "
                          f"got {qc.get('format')!r} / {qc.get('group_size')!r}")


def quantized_as(cfg) -> str | None:
    """q8 / q4 when the config says the checkpoint is cpumla-quantized, else None."""
    qc = getattr(cfg, "quantization_config", None) or {}
    return qc.get("format") if qc.get("quant_method") == "cpumla" else None

def quant_plan(name: str, dtype: str, shape, fmt: str) -> str | None:
    """The format a weight takes under --quant fmt, or None to keep it as stored. Kept: the MoE router
    (its logits pick experts: fp32 products, as transformers), V3.2's indexer (it picks the attended
    tokens), V4's mHC mixers, FP4 (already 4.25 bits), and widths not a multiple of 32. The output
    head (lm_head, or the embedding tied to it) and kv_b_proj (the per-head up-projection of the latent
    cache, under 0.5% of the bytes) are q8 under q4 too: docs/quantization.md measures both."""
    if dtype not in ("F32", "BF16", "F16", "F8_E4M3") or len(shape) != 2 or shape[1] % native.QBLOCK:
        return None
    if name.endswith(("mlp.gate.weight", "ffn.gate.weight")) or ".indexer." in name \
            or name.split(".")[-1].startswith("hc_"):
        return None
    if name in ("lm_head.weight", "head.weight", "model.embed_tokens.weight", "embed.weight") \
            or name.endswith("kv_b_proj.weight"):
        return "q8"
    return fmt


class Quantizer:
    """Quantize-on-load (cpumla.load(..., quant=)): linear() hands it each weight as stored, and it
    returns the q8 / q4 Weight quant_plan() asks for (else the weight unchanged), made on every thread
    (native.quantize) into huge-page memory. progress(done, total) is called with element counts after
    each step of rows: total is what the model's tensor table plans (set by plan_total)."""

    STEP = 1 << 22          # elements quantized between progress calls

    def __init__(self, fmt: str, progress=None):
        if fmt not in QUANTS:
            raise CpumlaError(f"--quant must be one of {', '.join(QUANTS)}, not '{fmt}'")
        self.fmt, self.progress = fmt, progress
        self.done, self.total = 0, 0
        self.formats: dict[str, int] = {}          # format -> weights made in it
        # every code and scale array in huge pages (small ones too), in mappings of this load's own that
        # go away with the last of its weights
        self.arena = _HugeArena()

    def plan_total(self, src, table: dict) -> int:
        """Elements the model's tensors (family tensors()) will quantize, for the progress total."""
        total = 0
        tied = not any(src.has(h) for h in ("lm_head.weight", "head.weight"))
        for name, (shape, kind) in table.items():
            if kind in ("norm", "bias") or (kind == "embed" and not tied):     # read by vector(): never quantized
                continue
            if src.has(name) and quant_plan(name, src.info(name)[0], src.info(name)[1], self.fmt):
                total += int(np.prod(shape))
        self.total = total
        return total

    def __call__(self, name: str, w: native.Weight) -> native.Weight:
        if w.dtype in QUANTS:
            raise CpumlaError(f"tensor '{name}' is already {w.dtype}: this checkpoint is quantized; leave out --quant")
        fmt = quant_plan(name, {"f32": "F32", "bf16": "BF16", "f16": "F16", "e4m3": "F8_E4M3"}.get(w.dtype, ""),
                         (w.rows, w.cols), self.fmt)
        if fmt is None:
            return w
        data = self.arena.empty((w.rows, w.cols // (2 if fmt == "q4" else 1)), np.int8 if fmt == "q8" else np.uint8,
                                small=True)
        scale = self.arena.empty((w.rows, w.cols // native.QBLOCK), np.float16, small=True)
        step = max(1, self.STEP // max(1, w.cols))
        out = None
        for r0 in range(0, w.rows, step):
            r1 = min(w.rows, r0 + step)
            out = native.quantize(w, fmt, data, scale, rows=(r0, r1))
            self.done += (r1 - r0) * w.cols
            if self.progress is not None:
                self.progress(self.done, max(self.total, self.done))
        self.formats[fmt] = self.formats.get(fmt, 0) + 1
        # the source (a dummy weight in the shared arena) dies with the caller's reference: let its
        # mapping die with it rather than stay resident as the arena's current block
        _arena.raw = None
        return out


def vector(src, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """A norm weight, bias or embedding table: float32, bf16 bits (uint16) or float16, as stored."""
    dtype = _checked(src, name, shape)
    if dtype not in ("F32", "BF16", "F16"):
        raise CpumlaError(f"{where(src, name)}: tensor '{name}' has dtype {dtype}; cpumla reads it as F32, BF16 or F16 only")
    return src.tensor(name)


def as_f32(v: np.ndarray) -> np.ndarray:
    if v.dtype == np.uint16:
        return (v.astype(np.uint32) << 16).view(np.float32)
    return v.astype(np.float32)


class DummySource:
    """Deterministic random tensors (from seed and tensor name), scaled so activations stay finite
    through every layer: linear weights ~ N(0, 1/in), norms 1, embeddings N(0, 1). dtype "bf16" (as
    V2 ships) or "fp8" (FP8 e4m3 linears with f32 128x128 block scales, as V3 ships; embeddings, norms
    and the router stay bf16/f32)."""

    def __init__(self, table: dict, block: tuple[int, int] = (128, 128), seed: int = 0, dtype: str = "bf16"):
        """table: name -> (shape, kind), the family's tensors(); kind "linear" is FP8 in an FP8 model,
        "plain" a matrix that stays bf16, "embed", "norm" and "bias" as their names say. V4's kinds keep
        its release formats in any dtype but "f32": "e4m3" (FP8 with an E8M0 `.scale` per 128x128),
        "e2m1" (FP4 packed two per byte as I8, E8M0 `.scale` per 1x32), "f32" (always F32) and "ids:E"
        (an I64 token-id table of experts below E)."""
        if dtype not in DUMMY_DTYPES:
            raise CpumlaError(f"dummy weight dtype must be one of {', '.join(DUMMY_DTYPES)}, got '{dtype}'")
        self.block, self.seed, self.dtype = tuple(block), seed, dtype
        self.table = table
        self.scales: dict[str, str] = {}
        if dtype == "fp8":
            for name, (shape, kind) in list(self.table.items()):
                if kind == "linear":
                    self.scales[name + "_scale_inv"] = name
        # kinds "e4m3" / "e2m1": shipped in that format whatever the dtype (V4), except in an f32 model;
        # their E8M0 scale grids are named as V4's release names them (`X.weight` -> `X.scale`)
        self.e8m0: dict[str, str] = {}
        if dtype != "f32":
            for name, (shape, kind) in self.table.items():
                if kind in ("e4m3", "e2m1"):
                    self.e8m0[(name[:-len("weight")] if name.endswith(".weight") else name + ".") + "scale"] = name

    def has(self, name: str) -> bool:
        return name in self.table or name in self.scales or name in self.e8m0

    def _kind_dtype(self, name: str) -> str:
        shape, kind = self.table[name]
        if kind in ("bias", "f32"):
            return "F32"
        if kind.startswith("ids:"):
            return "I64"
        if kind in ("e4m3", "e2m1") and self.dtype != "f32":
            return "F8_E4M3" if kind == "e4m3" else "I8"
        if self.dtype == "f32":
            return "F32"
        if self.dtype == "fp8" and name + "_scale_inv" in self.scales:
            return "F8_E4M3"
        return "BF16"

    def info(self, name: str):
        if name in self.e8m0:
            (r, c), kind = self.table[self.e8m0[name]]
            return "F8_E8M0", ((-(-r // self.block[0]), -(-c // self.block[1])) if kind == "e4m3" else (r, -(-c // 32)))
        if name in self.table and self._kind_dtype(name) == "I8":
            r, c = self.table[name][0]
            return "I8", (r, c // 2)
        if name in self.scales:
            r, c = self.table[self.scales[name]][0]
            b = self.block
            return "F32", (-(-r // b[0]), -(-c // b[1]))
        return self._kind_dtype(name), self.table[name][0]

    def _rng(self, name: str) -> np.random.Generator:
        return np.random.default_rng([self.seed, zlib.crc32(name.encode())])

    def tensor(self, name: str) -> np.ndarray:
        if name in self.e8m0:
            (r, c), kind = self.table[self.e8m0[name]]
            mean_square = E4M3_MEAN_SQUARE if kind == "e4m3" else E2M1_MEAN_SQUARE
            # the power of two nearest to a scale giving a row of random codes variance ~1/in
            code = 127 + int(round(-0.5 * np.log2(mean_square * c)))
            return _in_arena(np.full(self.info(name)[1], code, np.uint8))
        shape, kind = self.table.get(name, (None, ""))
        if kind.startswith("ids:"):
            return self._rng(name).integers(0, int(kind[4:]), size=shape, dtype=np.int64)
        if kind == "f32":
            return _in_arena(self._rng(name).standard_normal(shape, dtype=np.float32) / np.float32(np.sqrt(shape[-1])))
        if name in self.table and self._kind_dtype(name) == "I8":
            return _in_arena(self._rng(name).integers(0, 256, size=self.info(name)[1], dtype=np.uint8))
        if name in self.scales:
            shape = self.info(name)[1]
            cols = self.table[self.scales[name]][0][1]
            # scale so a row of random_e4m3 codes has variance ~1/in, like the bf16 dummies
            return np.full(shape, 1.0 / np.sqrt(E4M3_MEAN_SQUARE * cols), np.float32)
        shape, kind = self.table[name]
        rng = self._rng(name)
        if kind == "norm":
            v = np.ones(shape, np.float32)
            return v if self._kind_dtype(name) == "F32" else (v.view(np.uint32) >> 16).astype(np.uint16)
        if kind == "bias":
            return (rng.standard_normal(shape, dtype=np.float32) * 0.01).astype(np.float32)
        if self._kind_dtype(name) == "F8_E4M3":
            return random_e4m3(shape, rng)
        std = 1.0 if kind == "embed" else 1.0 / np.sqrt(shape[1])
        return random_normal(shape, std, rng, bf16=self._kind_dtype(name) == "BF16")


CHUNK = 1 << 16      # values drawn per tensor; the rest are rotations of them (dummy data, fast)


HUGE = 2 << 20
ARENA = 256 << 20


class _HugeArena:
    """Bump allocator over 256 MiB anonymous mappings backed by 2 MiB transparent huge pages (Linux, THP
    in madvise mode). A GEMV streaming GBs per token then walks 512x fewer pages and the hardware
    prefetchers, which stop at page boundaries, run on (~8% more read bandwidth measured here). Tensors
    sit back to back, so the huge pages waste nothing per tensor; the untouched tail of a mapping is
    never resident. Tensors under 2 MiB are packed in blocks of their own, so that a long-lived small one
    (a norm, a scale grid) never keeps alive the block of a large one that goes away (Quantizer: a
    weight's source once it is quantized)."""

    def __init__(self, small_apart: bool = True):
        self.raw, self.off = None, 0
        self.small = _HugeArena(small_apart=False) if small_apart else None    # tensors under 2 MiB

    def _map(self, size: int) -> np.ndarray:
        m = mmap.mmap(-1, size + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        try:
            m.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass
        raw = np.frombuffer(m, dtype=np.uint8)       # arrays made from it keep the mapping alive
        return raw[(-raw.ctypes.data) % HUGE:]

    def empty(self, shape, dtype, small: bool = False) -> np.ndarray:
        """An uninitialised array; under 2 MiB a plain numpy one unless `small` (then packed in the arena)."""
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        if (n < HUGE and not small) or not hasattr(mmap, "MADV_HUGEPAGE"):
            return np.empty(shape, dtype)
        if n > ARENA // 4:                            # big tensors get a mapping of their own
            raw = self._map((n + HUGE - 1) & ~(HUGE - 1))
            return raw[:n].view(dtype).reshape(shape)
        if n < HUGE and self.small is not None:
            return self.small.empty(shape, dtype, small=True)
        if self.raw is None or self.off + n > ARENA:
            self.raw, self.off = self._map(ARENA), 0
        a = self.raw[self.off:self.off + n].view(dtype).reshape(shape)
        self.off = (self.off + n + 63) & ~63
        return a


_arena = _HugeArena()
hugepage_empty = _arena.empty


def _in_arena(a: np.ndarray) -> np.ndarray:
    """a copied into the huge-page arena: V4's release-format dummies (FP4 codes, E8M0 scale grids, fp32
    matrices such as the mHC weights), which the forward streams every token, sit in huge pages as the
    linear weights of 2 MiB and more do (random_normal, random_e4m3). V4-Flash's FP4 experts, on 4 KiB
    pages for about half of their bytes, read 14% slower (Intel Xeon, docs/benchmarks.md)."""
    out = hugepage_empty(a.shape, a.dtype, small=True)
    np.copyto(out, a)
    return out


def random_normal(shape, std: float, rng: np.random.Generator, bf16: bool) -> np.ndarray:
    """N(0, std^2) values as float32 or bf16 bits (truncated: fine for noise). One chunk is drawn;
    later chunks are random rotations with random signs of it, so a multi-GB dummy model builds at
    memory speed and peak memory stays near the output's own size."""
    out = hugepage_empty(shape, np.uint16 if bf16 else np.float32)
    flat = out.reshape(-1)
    base = rng.standard_normal(min(CHUNK, flat.size), dtype=np.float32) * np.float32(std)
    if bf16:
        base = (base.view(np.uint32) >> 16).astype(np.uint16)
    sign = np.uint16(0x8000) if bf16 else None
    for i in range(0, flat.size, base.size):
        n = min(base.size, flat.size - i)
        shift = int(rng.integers(0, base.size))
        chunk = flat[i:i + n]
        chunk[:] = np.roll(base, shift)[:n]
        if rng.integers(0, 2):
            if bf16:
                chunk ^= sign
            else:
                np.negative(chunk, out=chunk)
    return out


E4M3_MEAN_SQUARE = float(np.mean([(2.0 ** (e - 7) * (1 + m / 8)) ** 2 for e in range(5, 10) for m in range(8)]))


E2M1_MEAN_SQUARE = float(np.mean(np.square([0, .5, 1, 1.5, 2, 3, 4, 6])))


def random_e4m3(shape, rng: np.random.Generator) -> np.ndarray:
    """Random FP8 e4m3 codes with exponents 5..9 (|value| in [0.25, 3.75]), random signs."""
    out = hugepage_empty(shape, np.uint8)
    flat = out.reshape(-1)
    for i in range(0, flat.size, CHUNK * 16):       # chunks keep the temporaries small
        n = min(CHUNK * 16, flat.size - i)
        sign = rng.integers(0, 2, size=n, dtype=np.uint8) << 7
        exp = rng.integers(5, 10, size=n, dtype=np.uint8) << 3
        flat[i:i + n] = sign | exp | rng.integers(0, 8, size=n, dtype=np.uint8)
    return out
