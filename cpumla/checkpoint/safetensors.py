"""Zero-copy safetensors reader: one read-only mmap per shard, tensors are numpy views into it.

We do not use the `safetensors` package here: the hot path needs raw views (and, later, raw
pointers and file offsets for the native kernels) into the mapped file, never a copy or a torch
tensor. The format is simple:

    u64 little-endian N | N bytes of JSON header | data section (raw little-endian tensors)
    header = {name: {"dtype": str, "shape": [int], "data_offsets": [begin, end]}, "__metadata__": {...}}

Offsets are relative to the start of the data section. Opening a file reads only its header, so
opening a checkpoint costs O(header size), not O(model size). Nothing is ever unpickled; write_file
writes new files only (`cpumla quantize`).
A tensor whose data is not aligned to its element size (a header of odd length) is the one
exception to zero copy: it is copied once, aligned. A file truncated on disk while mapped ends the
process with SIGBUS when a missing page is read (the kernel's doing; nothing in Python can catch it).
"""

from __future__ import annotations

import json
import math
import mmap
import os
from pathlib import Path

import numpy as np

from cpumla.checkpoint.jsonfile import parse_json
from cpumla.errors import CpumlaError

MAX_HEADER_BYTES = 100_000_000  # same limit as the safetensors package

# safetensors dtype -> (numpy view dtype, bits per element). Formats numpy lacks are exposed as
# their raw bit patterns: BF16 as uint16, FP8 (E4M3 / E5M2 / E8M0 scales) as uint8, and I8 as
# uint8 because in V4 it is packed FP4 (two e2m1 nibbles per byte), not signed integers.
DTYPES: dict[str, tuple[np.dtype, int]] = {
    "F64": (np.dtype("<f8"), 64),
    "F32": (np.dtype("<f4"), 32),
    "F16": (np.dtype("<f2"), 16),
    "BF16": (np.dtype("<u2"), 16),
    "F8_E4M3": (np.dtype("u1"), 8),
    "F8_E5M2": (np.dtype("u1"), 8),
    "F8_E8M0": (np.dtype("u1"), 8),
    "F4": (np.dtype("u1"), 4),  # packed: shape counts nibbles, two per byte
    "I8": (np.dtype("u1"), 8),
    "U8": (np.dtype("u1"), 8),
    "I16": (np.dtype("<i2"), 16),
    "U16": (np.dtype("<u2"), 16),
    "I32": (np.dtype("<i4"), 32),
    "U32": (np.dtype("<u4"), 32),
    "I64": (np.dtype("<i8"), 64),
    "U64": (np.dtype("<u8"), 64),
    "BOOL": (np.dtype("?"), 8),
}

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
INDEX_NAME = "model.safetensors.index.json"


def nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * DTYPES[dtype][1] // 8


def _no_duplicate_keys(pairs):
    out = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


class SafetensorsFile:
    """One .safetensors file, mapped read-only; `tensor(name)` is a view, never a copy."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError as e:
            raise CpumlaError(f"{self.path}: cannot open: {e.strerror}") from None
        try:
            size = os.fstat(fd).st_size
            if size < 8:
                raise CpumlaError(f"{self.path}: {size} bytes is too short for a safetensors file")
            self._mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
            if hasattr(mmap, "MADV_HUGEPAGE"):   # lets the kernel back the page cache with 2 MiB pages
                try:
                    self._mm.madvise(mmap.MADV_HUGEPAGE)
                except OSError:
                    pass
        finally:
            os.close(fd)  # the mapping keeps its own reference to the file
        try:
            self._entries, self.metadata = self._parse_header(size)
        except BaseException:
            self._mm.close()
            raise

    def _parse_header(self, size: int):
        where = self.path
        hlen = int.from_bytes(self._mm[:8], "little")
        if hlen < 2 or hlen > MAX_HEADER_BYTES:
            raise CpumlaError(f"{where}: header length {hlen} is absurd (not a safetensors file?)")
        if hlen > size - 8:
            raise CpumlaError(f"{where}: header length {hlen} is past the end of the file ({size} bytes)")
        try:
            text = self._mm[8:8 + hlen].decode("utf-8")
        except UnicodeDecodeError as e:
            raise CpumlaError(f"{where}: header is not valid JSON: {e}") from None
        header = parse_json(text, str(where), "header is not valid JSON", object_pairs_hook=_no_duplicate_keys)
        if not isinstance(header, dict):
            raise CpumlaError(f"{where}: header is a JSON {type(header).__name__}, not an object")

        self._data_start = 8 + hlen
        data_len = size - self._data_start
        metadata = header.pop("__metadata__", None)
        if metadata is not None and not isinstance(metadata, dict):
            raise CpumlaError(f"{where}: __metadata__ is not an object")
        entries: dict[str, tuple[str, tuple[int, ...], int, int]] = {}  # name -> dtype, shape, begin, end
        for name, e in header.items():
            entries[name] = self._check_entry(name, e)
        # Truncated downloads are the common case: say so, rather than "offset out of range".
        if entries:
            last = max(entries, key=lambda n: entries[n][3])
            if entries[last][3] > data_len:
                raise CpumlaError(
                    f"{where}: truncated: tensor '{last}' ends at data byte {entries[last][3]} "
                    f"but the data section has only {data_len} bytes (file {size} bytes; re-download it)")
        spans = sorted((b, e, n) for n, (_, _, b, e) in entries.items() if e > b)
        for (_, end0, n0), (begin1, _, n1) in zip(spans, spans[1:]):
            if begin1 < end0:
                raise CpumlaError(f"{where}: tensors '{n0}' and '{n1}' overlap in the data section")
        return entries, metadata or {}

    def _check_entry(self, name, e):
        where = f"{self.path}: tensor '{name}'"
        if not isinstance(e, dict) or set(e) != {"dtype", "shape", "data_offsets"}:
            raise CpumlaError(f"{where}: header entry must have exactly dtype, shape and data_offsets")
        dtype, shape, offsets = e["dtype"], e["shape"], e["data_offsets"]
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise CpumlaError(f"{where}: unknown dtype {dtype!r} (known: {', '.join(DTYPES)})")
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise CpumlaError(f"{where}: shape {shape!r} is not a list of non-negative integers")
        if (not isinstance(offsets, list) or len(offsets) != 2
                or not all(type(o) is int for o in offsets) or not 0 <= offsets[0] <= offsets[1]):
            raise CpumlaError(f"{where}: data_offsets {offsets!r} is not [begin, end] with 0 <= begin <= end")
        shape = tuple(shape)
        bits = DTYPES[dtype][1]
        if bits < 8 and math.prod(shape) * bits % 8:
            raise CpumlaError(f"{where}: {dtype} shape {list(shape)} does not fill whole bytes")
        begin, end = offsets
        want = nbytes(dtype, shape)
        if end - begin != want:
            raise CpumlaError(
                f"{where}: {dtype} {list(shape)} needs {want} bytes but data_offsets span {end - begin}")
        return dtype, shape, begin, end

    # ---- queries ---------------------------------------------------------------------------

    def keys(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def _entry(self, name: str):
        try:
            return self._entries[name]
        except KeyError:
            raise CpumlaError(f"{self.path}: no tensor named '{name}'") from None

    def info(self, name: str) -> tuple[str, tuple[int, ...]]:
        """(safetensors dtype string, shape) without touching the data."""
        dtype, shape, _, _ = self._entry(name)
        return dtype, shape

    def span(self, name: str) -> tuple[int, int]:
        """Absolute [start, end) byte offsets of the tensor's data in the file (for native readers)."""
        _, _, begin, end = self._entry(name)
        return self._data_start + begin, self._data_start + end

    @property
    def nbytes(self) -> int:
        return sum(end - begin for _, _, begin, end in self._entries.values())

    def tensor(self, name: str) -> np.ndarray:
        """A read-only numpy view into the mapping (see DTYPES for the exposed dtypes)."""
        dtype, shape, begin, end = self._entry(name)
        view_dtype, bits = DTYPES[dtype]
        if bits < 8:  # packed sub-byte: expose bytes, last dim shrinks by the packing factor
            count = end - begin
            shape = (*shape[:-1], shape[-1] * bits // 8) if shape and shape[-1] * bits % 8 == 0 else (count,)
        else:
            count = math.prod(shape)
        arr = np.frombuffer(self._mm, dtype=view_dtype, count=count, offset=self._data_start + begin)
        if not arr.flags.aligned:
            # The format does not promise aligned data (a header padded to an odd length shifts every
            # tensor); the kernels read elements through typed pointers, so such a tensor is copied
            # once, aligned, rather than read misaligned.
            arr = arr.copy()
        return arr.reshape(shape)

    def mapping(self) -> tuple[int, int, str]:
        """(address, bytes, path) of the file's mapping, which starts at its byte 0."""
        view = np.frombuffer(self._mm, np.uint8)
        return view.ctypes.data, view.size, str(self.path)

    # ---- lifecycle -------------------------------------------------------------------------

    def close(self) -> None:
        try:
            self._mm.close()
        except BufferError:
            pass  # views are still alive; the mapping goes away with the last of them

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self) -> str:
        return f"SafetensorsFile({str(self.path)!r}, {len(self._entries)} tensors)"


class Checkpoint:
    """A model directory: sharded via model.safetensors.index.json, or every *.safetensors in it."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise CpumlaError(f"{self.directory}: not a directory")
        self.files: dict[str, SafetensorsFile] = {}  # shard file name -> file
        self._where: dict[str, SafetensorsFile] = {}  # tensor name -> file holding it
        try:
            index = self.directory / INDEX_NAME
            if index.is_file():
                self._open_index(index)
            else:
                self._open_all()
        except BaseException:
            self.close()
            raise

    def _open_index(self, index: Path) -> None:
        try:
            text = index.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise CpumlaError(f"{index}: cannot read the index: {e}") from None
        doc = parse_json(text, f"{index}")
        weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
        if not isinstance(weight_map, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
            raise CpumlaError(f"{index}: no 'weight_map' object of tensor name -> shard file")
        shards = sorted(set(weight_map.values()))
        for shard in shards:
            if Path(shard).name != shard:
                raise CpumlaError(f"{index}: shard '{shard}' is not a plain file name in {self.directory}")
            if not (self.directory / shard).is_file():
                raise CpumlaError(f"{index}: lists shard '{shard}', which is missing from {self.directory}")
        for shard in shards:
            self._add(shard)
        for name, shard in weight_map.items():
            holder = self._where.get(name)
            if holder is None or holder is not self.files[shard]:
                raise CpumlaError(f"{index}: says tensor '{name}' is in '{shard}', but that shard lacks it")

    def _open_all(self) -> None:
        shards = sorted(p.name for p in self.directory.glob("*.safetensors") if p.is_file())
        if not shards:
            pickles = sorted(p.name for p in self.directory.iterdir() if p.suffix in PICKLE_SUFFIXES)
            if pickles:
                shown = ", ".join(pickles[:3]) + (", …" if len(pickles) > 3 else "")
                raise CpumlaError(
                    f"{self.directory}: contains only a PyTorch pickle checkpoint ({shown}); "
                    "cpumla reads safetensors only and never unpickles")
            raise CpumlaError(f"{self.directory}: no *.safetensors files and no {INDEX_NAME}")
        for shard in shards:
            self._add(shard)

    def _add(self, shard: str) -> None:
        f = SafetensorsFile(self.directory / shard)
        self.files[shard] = f
        for name in f.keys():
            other = self._where.get(name)
            if other is not None:
                raise CpumlaError(f"{self.directory}: tensor '{name}' is in both {other.path.name} and {shard}")
            self._where[name] = f

    def _file(self, name: str) -> SafetensorsFile:
        try:
            return self._where[name]
        except KeyError:
            raise CpumlaError(f"{self.directory}: checkpoint has no tensor '{name}'") from None

    def keys(self) -> list[str]:
        return list(self._where)

    def has(self, name: str) -> bool:
        return name in self._where

    def mappings(self) -> list[tuple[int, int, str]]:
        """(address, bytes, path) of each shard's mapping: where tensor views point."""
        return [f.mapping() for f in self.files.values()]

    __contains__ = has

    def __len__(self) -> int:
        return len(self._where)

    def info(self, name: str) -> tuple[str, tuple[int, ...]]:
        return self._file(name).info(name)

    def tensor(self, name: str) -> np.ndarray:
        return self._file(name).tensor(name)

    def file_of(self, name: str) -> Path:
        return self._file(name).path

    def tensor_nbytes(self, name: str) -> int:
        """Bytes of one tensor's data, from its header entry."""
        a, b = self._file(name).span(name)
        return b - a

    @property
    def nbytes(self) -> int:
        return sum(f.nbytes for f in self.files.values())

    def close(self) -> None:
        for f in self.files.values():
            f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self) -> str:
        return f"Checkpoint({str(self.directory)!r}, {len(self.files)} shards, {len(self._where)} tensors)"


def write_file(path: str | os.PathLike, entries, metadata: dict | None = None) -> int:
    """Writes a .safetensors file: entries [(name, dtype, shape, get)] in that order, get() returning
    the tensor (an array whose bytes are the data, called once, when its turn comes). The header is
    padded with spaces so the data section starts 64-byte aligned. Returns the bytes written; OSError
    (a full disk) propagates."""
    header: dict = {}
    off = 0
    for name, dtype, shape, _ in entries:
        n = nbytes(dtype, tuple(shape))
        header[name] = {"dtype": dtype, "shape": [int(d) for d in shape], "data_offsets": [off, off + n]}
        off += n
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * ((-(8 + len(text))) % 64)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for name, dtype, shape, get in entries:
            a = np.ascontiguousarray(get())
            want = header[name]["data_offsets"][1] - header[name]["data_offsets"][0]
            if a.nbytes != want:
                raise CpumlaError(f"{path}: tensor '{name}' has {a.nbytes} bytes, its header says {want}")
            f.write(a.reshape(-1).view(np.uint8).data)
        f.flush()
        os.fsync(f.fileno())
    return 8 + len(text) + off
