"""What memory this process may still use (MemAvailable, and the cgroup's limit less its usage, cgroup v2
or v1), and the refusal of a model whose anonymous memory would not fit in it."""

from __future__ import annotations

import os
from pathlib import Path

from cpumla.errors import CpumlaError

GIB = 1 << 30


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return int(text) if text.isdigit() else None     # "max" (no limit) and unreadable files: None


def _stat_value(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) >= 2 and parts[0] == key and parts[1].isdigit():
                return int(parts[1])
    except (OSError, UnicodeDecodeError):
        pass
    return 0


def cgroup_room(proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = Path("/sys/fs/cgroup")):
    """(bytes the cgroup lets this process still use, its directory) for the tightest limit on the
    way up from this process's cgroup (v2 memory.max, or v1 memory.limit_in_bytes); reclaimable
    file pages count as free. None without a limit."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    best = None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":                              # v2
            base = root if (root / "cgroup.controllers").exists() or not (root / "unified").is_dir() \
                else root / "unified"                                       # hybrid hierarchy
            files = ("memory.max", "memory.current", "memory.stat", "inactive_file")
        elif "memory" in parts[1].split(","):                               # v1
            base, files = root / "memory", ("memory.limit_in_bytes", "memory.usage_in_bytes", "memory.stat",
                                            "total_inactive_file")
        else:
            continue
        d = base / parts[2].lstrip("/")
        while True:
            limit = _read_int(d / files[0])
            if limit is not None and limit < 1 << 60:                      # v1 "no limit" is ~2^63
                used = _read_int(d / files[1]) or 0
                room = max(0, limit - used + _stat_value(d / files[2], files[3]))
                if best is None or room < best[0]:
                    best = (room, d)
            if d == base or base not in d.parents:
                break
            d = d.parent
    return best


def available_memory() -> tuple[int, str]:
    """(bytes this process can still allocate, where that number comes from). The environment variable
    CPUMLA_MEMORY_AVAILABLE (bytes) replaces the measurement: a test hook."""
    forced = os.environ.get("CPUMLA_MEMORY_AVAILABLE", "").strip()
    if forced:
        if not forced.isdigit():
            raise CpumlaError(f"CPUMLA_MEMORY_AVAILABLE must be a byte count, got {forced!r}")
        return int(forced), "CPUMLA_MEMORY_AVAILABLE"
    avail, what = None, "unknown"
    v = _stat_value(Path("/proc/meminfo"), "MemAvailable:")
    if v:
        avail, what = v * 1024, "MemAvailable"
    cg = cgroup_room()
    if cg is not None and (avail is None or cg[0] < avail):
        avail, what = cg[0], f"cgroup limit of {cg[1]}"
    return (avail if avail is not None else 1 << 62), what


def gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB" if n < 1 << 50 else f"{n:.3g} bytes"


def check_memory(need: dict[str, int], dummy: bool, where: str, hint=None) -> None:
    """Refuses (CpumlaError) when the anonymous memory a model needs exceeds what is available.
    hint(): the --quant that would fit, or None (asked only when refusing)."""
    anon = need["cache"] + need["scratch"] + (need["weights"] if dummy else 0)
    avail, what = available_memory()
    if anon > avail:
        parts = (f"weights {gib(need['weights'])}, " if dummy else "") + \
            f"caches {gib(need['cache'])}, scratch {gib(need['scratch'])}"
        q = hint() if hint is not None else None
        raise CpumlaError(f"{where}: needs {gib(anon)} of memory ({parts}) but {gib(avail)} is available "
                          f"({what}); " + (f"--quant {q} would fit" if q else
                                           "use a smaller --ctx / max_seq_len or a smaller model"))
