"""llama.cpp's GGUF files as a weight source: one `.gguf`, a folder holding one, or a split set
(`name-00001-of-00003.gguf` ...), memory-mapped and read in place.

The metadata and the tensor index are read with the `gguf` package's GGUFReader (the format's own
library; it maps the file with numpy). Its tensor table is replaced by a checked one: every tensor's
type code is known, its dimensions and byte count agree, and its data lies inside the file, or one
CpumlaError line names the file and the tensor. Tensor data is never copied: a tensor is a numpy view
of the mapping (F32 float32, F16 float16, BF16 uint16 bit patterns, a block type (Q8_0, Q4_K, IQ2_XXS ...) its raw
blocks as uint8 [rows, row bytes]), so a file larger than RAM maps and runs from the page cache.

The source speaks Hugging Face names (has / info / tensor, as checkpoint/safetensors.py's Checkpoint):
gguf_names.py maps them to the file's names and builds the config dict from the metadata. GGUF lists
dimensions fastest first (ne0 = columns); shapes here are numpy's, [rows, cols]; a stacked expert
tensor [E, I, D] serves expert e's [I, D] as a view.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path

import numpy as np

from cpumla.errors import CpumlaError

# the tensor types a model can be read from: numpy view dtype, block (elements), bytes per block
PLAIN = {"F32": (np.dtype("<f4"), 1, 4), "F16": (np.dtype("<f2"), 1, 2), "BF16": (np.dtype("<u2"), 1, 2)}
BLOCK_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS",
               "IQ2_XXS", "IQ3_XXS", "IQ1_S", "IQ1_M", "MXFP4")   # their raw blocks, as uint8 [rows, row bytes]


def _block_types() -> dict:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    return {t: (np.dtype("u1"),) + tuple(GGML_QUANT_SIZES[GGMLQuantizationType[t]]) for t in BLOCK_TYPES}


PLAIN.update(_block_types())
SPLIT = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<n>\d{5})\.gguf$")


def is_first_file(name: str) -> bool:
    """Whether a GGUF file's name is a model's first: a single file, or shard 00001 of a split set."""
    m = SPLIT.match(name)
    return not m or m["no"] == "00001"


def is_mtp_file(name: str) -> bool:
    """Whether a GGUF file's name marks it an MTP layer of its own (llama.cpp's converter, `--mtp`, writes
    one as `mtp-` + the model's file name): not a model, a draft beside one."""
    return name.lower().startswith("mtp-")


def pick_mtp(model: str, names: list[str]) -> str | None:
    """Of the MTP files' names in a model's folder (split sets by their first shard), the model's: `mtp-`
    + the model file's name, else the only one, else None."""
    named = [n for n in names if n.lower() == "mtp-" + model.lower()]
    return named[0] if named else names[0] if len(names) == 1 else None


def mtp_sidecar(first: Path) -> Path | None:
    """The MTP file beside a model's first file (pick_mtp), or None."""
    names = sorted(p.name for p in first.parent.glob("*.gguf") if p.is_file() and is_mtp_file(p.name)
                   and is_first_file(p.name))
    name = pick_mtp(first.name, names)
    return None if name is None else first.with_name(name)


def gguf_files(path: Path) -> list[Path]:
    """The files of a GGUF model: path itself, a split set's every shard from its first (any shard may
    be named), or the one GGUF model in a folder (an MTP file, is_mtp_file, is not one). CpumlaError for
    a missing shard or an ambiguous folder."""
    if path.is_dir():
        found = sorted(p for p in path.glob("*.gguf") if p.is_file() and not is_mtp_file(p.name))
        firsts = [p for p in found if is_first_file(p.name)]
        if not firsts:
            raise CpumlaError(f"{path}: holds no .gguf file")
        if len(firsts) > 1:
            raise CpumlaError(f"{path}: holds {len(firsts)} GGUF models ({', '.join(p.name for p in firsts[:3])}); "
                              f"pass the file")
        path = firsts[0]
    m = SPLIT.match(path.name)
    if not m:
        return [path]
    n = int(m["n"])
    if n < 1:
        raise CpumlaError(f"{path}: a split set of {n} files")
    files = [path.with_name(f"{m['stem']}-{i:05d}-of-{n:05d}.gguf") for i in range(1, n + 1)]
    for i, f in enumerate(files):
        if not f.is_file():
            raise CpumlaError(f"{f}: shard {i + 1} of {n} of the split GGUF is missing")
    return files


class Entry:
    """One tensor of a GGUF file: its type name, numpy shape, where its data lies."""
    __slots__ = ("name", "type", "shape", "offset", "nbytes", "file")

    def __init__(self, name, type_, shape, offset, nbytes, file):
        self.name, self.type, self.shape, self.offset, self.nbytes, self.file = name, type_, shape, offset, nbytes, file


def open_reader(path: Path):
    """A GGUFReader over `path` whose tensor table is the checked one of entries(); CpumlaError (one line
    naming the file) for anything GGUFReader cannot parse."""
    from gguf import GGUFReader

    class Reader(GGUFReader):
        def _build_tensors(self, start_offs, fields):        # the checked table instead of GGUFReader's views
            self.entries = table(path, int(self.data.size), int(start_offs), fields)
            self.tensors = []

    try:
        return Reader(path)
    except CpumlaError:
        raise
    except (ValueError, IndexError, TypeError, OverflowError, UnicodeDecodeError, KeyError) as e:
        raise CpumlaError(f"{path}: not a readable GGUF file ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
    except OSError as e:
        raise CpumlaError(f"{path}: cannot read: {e.strerror or e}") from None


def table(path: Path, size: int, start: int, fields) -> dict[str, Entry]:
    """The tensor infos checked: a known type code, whole blocks, data inside the file, no name twice."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    out: dict[str, Entry] = {}
    for f in fields:
        _, name_data, _, dims, raw_type, offset = f.parts
        try:
            name = bytes(name_data).decode("utf-8")
        except UnicodeDecodeError:
            raise CpumlaError(f"{path}: a tensor name is not UTF-8") from None
        code = int(raw_type[0])
        try:
            kind = GGMLQuantizationType(code)
        except ValueError:
            raise CpumlaError(f"{path}: tensor '{name}' has type code {code}, which is not a GGUF tensor type") from None
        if name in out:
            raise CpumlaError(f"{path}: tensor '{name}' is listed twice")
        ne = [int(d) for d in dims]
        block, per = GGML_QUANT_SIZES[kind]
        if not ne or any(d <= 0 for d in ne) or ne[0] % block:
            raise CpumlaError(f"{path}: tensor '{name}' ({kind.name}) has dimensions {ne}, which are not whole "
                              f"blocks of {block}")
        nbytes = math.prod(ne) // block * per
        at = start + int(offset[0])
        if at + nbytes > size:
            raise CpumlaError(f"{path}: tensor '{name}' ({kind.name} {ne}) ends at byte {at + nbytes}, past the end of "
                              f"the file ({size} bytes): truncated or a bad offset")
        out[name] = Entry(name, kind.name, tuple(reversed(ne)), at, nbytes, path)
    spans = sorted((e.offset, e.offset + e.nbytes, n) for n, e in out.items())
    for (_, end0, n0), (begin1, _, n1) in zip(spans, spans[1:]):
        if begin1 < end0:
            raise CpumlaError(f"{path}: tensors '{n0}' and '{n1}' overlap")
    return out


class GGUFFile:
    """The tensors and metadata of one or more GGUF files (a split set), by their GGUF names."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.files = gguf_files(self.path)
        readers = [open_reader(f) for f in self.files]
        self.entries: dict[str, Entry] = {}
        self._data = {}
        for f, r in zip(self.files, readers):
            self._data[f] = r.data
            for name, e in r.entries.items():
                if name in self.entries:
                    raise CpumlaError(f"{f}: tensor '{name}' is also in {self.entries[name].file.name}")
                self.entries[name] = e
        # The metadata as python values, and the readers let go: GGUFReader keeps a numpy view per part of
        # every field (two per string: 600k for a 129k vocabulary and its merges), which the garbage
        # collector would walk for as long as the model lives; the values' strings and numbers it does not.
        self._values = {k: _field_value(f) for k, f in readers[0].fields.items()}

    def value(self, key: str):
        """(GGUF type name, python value) of a metadata key, or None when absent; arrays as lists."""
        got = self._values.get(key)
        if got is None:
            return None
        name, v, err = got
        if err is not None:
            raise CpumlaError(f"{self.files[0]}: metadata key '{key}' cannot be read ({err})")
        return name, list(v) if isinstance(v, list) else v

    def array(self, name: str) -> np.ndarray:
        """Tensor `name` as a read-only view of its file's mapping, numpy shape, no copy."""
        e = self.entries[name]
        if e.type not in PLAIN:
            raise CpumlaError(f"{e.file}: tensor '{name}' has type {e.type}, which cpumla does not read "
                              f"({', '.join(PLAIN)})")
        dt, block, per = PLAIN[e.type]
        shape = e.shape[:-1] + (e.shape[-1] // block * per // dt.itemsize,)
        arr = np.frombuffer(self._data[e.file], dtype=dt, count=e.nbytes // dt.itemsize, offset=e.offset)
        if not arr.flags.aligned:
            raise CpumlaError(f"{e.file}: tensor '{name}' starts at byte {e.offset}, not aligned to its "
                              f"{dt.itemsize}-byte elements")
        return arr.reshape(shape)

    def raw(self, name: str) -> np.ndarray:
        """Tensor `name`'s bytes as a uint8 view of its file's mapping, whatever its type."""
        e = self.entries[name]
        return np.frombuffer(self._data[e.file], np.uint8, e.nbytes, e.offset)

    def mappings(self) -> list[tuple[int, int, str]]:
        """(address, bytes, path) of each file's mapping, which starts at its byte 0."""
        return [(d.ctypes.data, d.size, str(f)) for f, d in self._data.items()]

    def close(self) -> None:
        """Drops the mappings: each goes with the last view of it still alive."""
        self._data = {}


def _field_value(f) -> tuple:
    """(GGUF type name, python value, None) of a GGUFReader field, or (name, None, why) where it cannot be
    read (raised when the key is asked for)."""
    from gguf import GGUFValueType

    kind = f.types[0]
    name = kind.name if kind != GGUFValueType.ARRAY else f"ARRAY[{f.types[1].name if len(f.types) > 1 else '?'}]"
    try:
        return name, f.contents(), None
    except (ValueError, IndexError, UnicodeDecodeError) as e:
        return name, None, str(e)
