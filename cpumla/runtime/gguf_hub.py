"""The GGUF quantizations of a Hugging Face repo, from its file names: `REPO:QUANT` references (the
`-hf user/repo:Q4_K_M` form of llama.cpp and ollama), each model's files (one `.gguf`, or a split set
`name-00001-of-00003.gguf` ... anywhere in the repo), its quantization's name, and the repos' snapshots
in the local hub cache. Nothing here touches the network.

A quantization's name is the last part of the file name (split suffix dropped), or else of its folder,
that reads as a llama.cpp type: Q4_K_M, IQ2_XXS, Q8_0, TQ1_0, BF16, F16, F32, MXFP4_MOE, with a leading
`UD-` kept (UD-Q2_K_XL). A tag names the models whose path holds it, case-insensitively, as a whole
word: bounded by the path's start or end or by `-`, `.`, `/` (`_` is part of the name, so Q4_K does
not name Q4_K_M).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from cpumla.checkpoint.gguf import SPLIT, is_mtp_file, pick_mtp
from cpumla.errors import CpumlaError
from cpumla.runtime.hub_cache import hf_hub_cache

REPO_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")
QUANT_NAME = re.compile(r"^(?:I?Q\d+(?:_[A-Z0-9]+)*|TQ\d+_\d+|BF16|F16|F32|MXFP4(?:_MOE)?)$", re.IGNORECASE)


def parse_ref(ref: str) -> tuple[str, str | None]:
    """(repo id, quantization tag) of `user/repo:TAG`; the tag is None without a colon."""
    repo, colon, tag = ref.partition(":")
    if not colon:
        return ref, None
    if not REPO_ID.match(repo):
        raise CpumlaError(f"'{ref}': '{repo}' is not a repo id (user/name)")
    if not tag.strip():
        raise CpumlaError(f"'{ref}' names no quantization after the colon (e.g. {repo}:Q4_K_M)")
    return repo, tag.strip()


def is_ref(text: str) -> bool:
    """Whether `text` has the form user/repo:TAG."""
    repo, colon, tag = text.partition(":")
    return bool(colon) and bool(REPO_ID.match(repo))


def quant_name(path: str) -> str:
    """The quantization a GGUF file's path names (see the module's docstring); the file's stem if none."""
    p = PurePosixPath(path)
    m = SPLIT.match(p.name)
    stem = m["stem"] if m else p.name[:-len(".gguf")] if p.name.lower().endswith(".gguf") else p.name
    for text in (stem, p.parent.name):
        parts = re.split(r"[-.]", text)
        for i in range(len(parts) - 1, -1, -1):
            if QUANT_NAME.match(parts[i]):
                return (parts[i - 1] + "-" if i and parts[i - 1].upper() == "UD" else "") + parts[i]
    return stem


@dataclass
class Quant:
    """One GGUF model of a repo: a single file or a split set, by its paths in the repo."""
    name: str                         # its quantization, e.g. Q4_K_M
    shards: list[str]                 # every file it consists of, in order (one for a single file)
    sizes: dict[str, int] = field(default_factory=dict)   # bytes of the files present

    @property
    def first(self) -> str:
        return self.shards[0]

    @property
    def present(self) -> list[str]:
        return [s for s in self.shards if s in self.sizes]

    @property
    def missing(self) -> list[str]:
        return [s for s in self.shards if s not in self.sizes]

    @property
    def size(self) -> int:
        return sum(self.sizes.values())


def quants(files: dict[str, int | None], mtp: bool = False) -> list[Quant]:
    """The GGUF models among a repo's files ({path: bytes}), smallest first; mmproj files (vision
    projectors) and MTP files (`mtp-*`, a model's MTP layer on its own) are not models. A split set lists
    every shard its names promise, present or not. mtp: the MTP files instead, grouped the same way."""
    found: dict[tuple, Quant] = {}
    for path, size in files.items():
        p = PurePosixPath(path)
        if not p.name.lower().endswith(".gguf") or "mmproj" in p.name.lower() or is_mtp_file(p.name) != mtp:
            continue
        m = SPLIT.match(p.name)
        if m and int(m["n"]) >= 1:
            n = int(m["n"])
            key = (str(p.parent), m["stem"], n)
            shards = [str(p.parent / f"{m['stem']}-{i:05d}-of-{n:05d}.gguf") for i in range(1, n + 1)]
        else:
            key, shards = (path,), [path]
        q = found.setdefault(key, Quant(quant_name(path), [s.removeprefix("./") for s in shards]))
        q.sizes[path] = size or 0
    return sorted(found.values(), key=lambda q: (q.size, q.name.lower(), q.first))


def mtp_of(files: dict[str, int | None], q: Quant) -> Quant | None:
    """The MTP file (llama.cpp's converter's `--mtp`: `mtp-` + a model's name) of model q among a repo's
    files: in q's folder, as checkpoint/gguf.py's pick_mtp picks one beside a model; None if none."""
    folder = PurePosixPath(q.first).parent
    beside = {PurePosixPath(m.first).name: m for m in quants(files, mtp=True)
              if PurePosixPath(m.first).parent == folder}
    name = pick_mtp(PurePosixPath(q.first).name, sorted(beside))
    return None if name is None else beside[name]


def _names(tag: str, path: str) -> bool:
    return re.search(r"(?:^|[-./])" + re.escape(tag) + r"(?=[-./]|$)", path, re.IGNORECASE) is not None


def matching(tag: str, found: list[Quant]) -> list[Quant]:
    """The models `tag` names: a file's path, else those whose path holds it as a whole word; of
    several, the one whose quantization is the tag itself, when just one is."""
    t = tag.lower()
    by_path = [q for q in found if any(s.lower() == t for s in q.shards)]
    if by_path:
        return by_path
    hits = [q for q in found if _names(tag, q.first)]
    exact = [q for q in hits if q.name.lower() == t]
    return exact if len(hits) > 1 and len(exact) == 1 else hits


def snapshot(repo_id: str, revision: str | None = None) -> Path | None:
    """The snapshot folder of `repo_id` at `revision` (a branch, tag or commit; default main, else the
    newest snapshot) in the local hub cache, or None."""
    if not REPO_ID.match(repo_id) or (revision and ".." in revision.split("/")):
        return None
    repo = hf_hub_cache() / ("models--" + repo_id.replace("/", "--"))
    ref = repo / "refs" / (revision or "main")
    if ref.is_file():
        commit = ref.read_text().strip()
    elif revision:
        commit = revision
    else:
        snaps = [s for s in (repo / "snapshots").glob("*") if s.is_dir()]
        if not snaps:
            return None
        commit = max(snaps, key=lambda s: s.stat().st_mtime).name
    snap = repo / "snapshots" / commit
    return snap if commit and snap.is_dir() else None


def cached_files(snap: Path) -> dict[str, int]:
    """The GGUF files a snapshot holds ({path in the repo: bytes}); a file still downloading (no link
    yet) or a dangling link is not there."""
    out = {}
    for p in sorted(snap.rglob("*")):
        if p.name.lower().endswith(".gguf") and p.is_file():
            out[p.relative_to(snap).as_posix()] = p.stat().st_size
    return out


def human_size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n} B"


def _quant_list(found: list[Quant]) -> str:
    return ", ".join(f"{q.name} ({human_size(q.size)})" for q in found)


def choose(where: str, tag: str, found: list[Quant]) -> Quant:
    """The one GGUF model `tag` names among `found`, or a CpumlaError naming what there is."""
    hits = matching(tag, found)
    if len(hits) == 1:
        return hits[0]
    if not found:
        raise CpumlaError(f"{where}: holds no .gguf files")
    if not hits:
        raise CpumlaError(f"{where}: no GGUF quantization '{tag}'; it has {_quant_list(found)}")
    raise CpumlaError(f"{where}: '{tag}' names {len(hits)} GGUF models ({', '.join(q.first for q in hits)}); "
                      f"name one by its file, REPO:PATH")


def complete(ref: str, snap: Path, q: Quant, hint: str) -> Path:
    """The first file of `q` in the snapshot, once every shard is there; else a CpumlaError ending in hint."""
    for i, s in enumerate(q.shards):
        if not (snap / s).is_file():
            what = f"shard {i + 1} of {len(q.shards)}" if len(q.shards) > 1 else "the file"
            raise CpumlaError(f"{ref}: {what} ({s}) is not in the cache ({snap}); {hint}")
    return snap / q.first


def cached_path(ref: str) -> Path:
    """The first file of REPO:QUANT in the hub cache (main, else the newest snapshot), every shard there."""
    repo_id, tag = parse_ref(ref)
    snap = snapshot(repo_id)
    if snap is None:
        raise CpumlaError(f"{repo_id} is not in the Hugging Face cache ({hf_hub_cache()}); "
                          f"get it with `cpumla download {ref}`")
    q = choose(f"{repo_id} in the cache", tag, quants(cached_files(snap)))
    return complete(ref, snap, q, f"get it with `cpumla download {repo_id}:{q.name}`")
