"""What a GGUF model holds, from its tensor index alone (no tensor data is read): the tensor types and
bytes of each group of tensors, and the architecture a file's header names.

Groups, by llama.cpp's tensor names: attention (blk.N.attn_*), shared experts (ffn_*_shexp), routed
experts (ffn_*_exps, stacked), dense MLP (ffn_gate / ffn_up / ffn_down), embedding/head (token_embd,
output), the MTP layer (every tensor of the NextN blocks appended after the main layers, when the caller
says where they start), and norms/other: every *_norm, the router (ffn_gate_inp, exp_probs_b) and any
other tensor.
"""

from __future__ import annotations

import struct
from pathlib import Path

GROUPS = ("attention", "shared experts", "routed experts", "dense MLP", "embedding/head", "MTP layer",
          "norms/other")


def group_of(name: str, first_nextn: int | None = None) -> str:
    """The group of a tensor, by its GGUF name; first_nextn: the first NextN block's index, if any."""
    if name in ("token_embd.weight", "output.weight"):
        return "embedding/head"
    parts = name.split(".")
    if first_nextn is not None and len(parts) >= 3 and parts[0] == "blk" and parts[1].isdecimal() \
            and int(parts[1]) >= first_nextn:
        return "MTP layer"
    if len(parts) >= 3 and parts[0] == "blk":
        t = parts[2]
        if t.endswith("_norm"):
            return "norms/other"
        if t.startswith("attn_"):
            return "attention"
        if t.startswith("ffn_") and t.endswith("_exps"):
            return "routed experts"
        if t.startswith("ffn_") and t.endswith("_shexp"):
            return "shared experts"
        if t in ("ffn_gate", "ffn_up", "ffn_down"):
            return "dense MLP"
    return "norms/other"


def groups(entries, first_nextn: int | None = None, mtp_file=None) -> dict[str, dict]:
    """{group: {"tensors": n, "bytes": b, "types": {type: {"tensors": n, "bytes": b}}}} in GROUPS order
    (empty groups left out), from entries {name: object with .type and .nbytes} (gguf.Entry); mtp_file:
    the entries of an MTP file beside the model's, every one the MTP layer's."""
    out = {g: {"tensors": 0, "bytes": 0, "types": {}} for g in GROUPS}
    both = [(group_of(n, first_nextn), e) for n, e in entries.items()]
    both += [("MTP layer", e) for e in (mtp_file or {}).values()]
    for group, e in both:
        g = out[group]
        t = g["types"].setdefault(e.type, {"tensors": 0, "bytes": 0})
        for d in (g, t):
            d["tensors"] += 1
            d["bytes"] += e.nbytes
    for g in out.values():
        g["types"] = dict(sorted(g["types"].items(), key=lambda kv: -kv[1]["bytes"]))
    return {k: v for k, v in out.items() if v["tensors"]}


# value type codes of GGUF metadata and their sizes; 8 is a string, 9 an array
_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9


def architecture(path: Path) -> str | None:
    """general.architecture of a GGUF file, read from its header alone (writers put it first), or None
    when the file is not a GGUF file of version 2 or later or the key is not there."""
    try:
        with open(path, "rb") as f:
            head = f.read(24)
            if len(head) < 24 or head[:4] != b"GGUF" or struct.unpack_from("<I", head, 4)[0] < 2:
                return None
            n_kv = struct.unpack_from("<Q", head, 16)[0]
            for _ in range(min(n_kv, 1 << 16)):
                key = _string(f)
                kind = _u32(f)
                if key == "general.architecture" and kind == _STRING:
                    return _string(f)
                _skip(f, kind)
    except (OSError, ValueError, struct.error, UnicodeDecodeError):
        return None
    return None


def _u32(f) -> int:
    return struct.unpack("<I", _read(f, 4))[0]


def _u64(f) -> int:
    return struct.unpack("<Q", _read(f, 8))[0]


def _read(f, n: int) -> bytes:
    b = f.read(n)
    if len(b) != n:
        raise ValueError("truncated")
    return b


def _string(f) -> str:
    n = _u64(f)
    if n > 1 << 20:
        raise ValueError("string too long")
    return _read(f, n).decode("utf-8")


def _skip(f, kind: int, depth: int = 0) -> None:
    if kind in _FIXED:
        f.seek(_FIXED[kind], 1)
    elif kind == _STRING:
        f.seek(_u64(f), 1)
    elif kind == _ARRAY and depth < 4:
        item, n = _u32(f), _u64(f)
        if item in _FIXED:
            f.seek(_FIXED[item] * n, 1)
        else:
            for _ in range(n):
                _skip(f, item, depth + 1)
    else:
        raise ValueError(f"value type {kind}")
