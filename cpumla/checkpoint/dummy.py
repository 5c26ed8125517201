"""Dummy weights: deterministic random tensors (from a seed and the tensor's name) in the formats a real
checkpoint has, for `--dummy-weights`."""

from __future__ import annotations

import zlib

import numpy as np

from cpumla.checkpoint.arena import hugepage_empty, in_arena
from cpumla.errors import CpumlaError
from cpumla.sampling import check_seed

DUMMY_DTYPES = ("bf16", "fp8", "f32")     # --dummy-dtype: bf16 as V2 ships, FP8 block-scaled as V3, fp32


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
        check_seed(seed, "the dummy weights' seed", optional=False)
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
            return in_arena(np.full(self.info(name)[1], code, np.uint8))
        shape, kind = self.table.get(name, (None, ""))
        if kind.startswith("ids:"):
            return self._rng(name).integers(0, int(kind[4:]), size=shape, dtype=np.int64)
        if kind == "f32":
            return in_arena(self._rng(name).standard_normal(shape, dtype=np.float32) / np.float32(np.sqrt(shape[-1])))
        if name in self.table and self._kind_dtype(name) == "I8":
            return in_arena(self._rng(name).integers(0, 256, size=self.info(name)[1], dtype=np.uint8))
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
