"""Folders cpumla writes (a quantized checkpoint): never half-written, never at the cost of what is not ours.

The rules, for every folder the tool writes:
- it is built in a hidden folder beside its target (same file system) and renamed into place once
  complete, so an interrupted or failed write never leaves something that looks valid;
- it holds MARK, so a later `--force` knows it is cpumla's;
- an existing target is moved aside, and removed only once the rename succeeded (put back if not);
- `--force` replaces only an empty folder or one cpumla wrote, and never the current folder or one
  above it, a checkpoint being read or a folder holding one, the root, or a mount point.
"""

from __future__ import annotations

import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path

from cpumla.errors import CpumlaError

MARK = ".cpumla-output"


def written_by_cpumla(folder: Path) -> bool:
    """Whether cpumla wrote this folder: it holds MARK, or a config.json whose quantization_config is
    cpumla's (checkpoints written before the mark)."""
    if (folder / MARK).is_file():
        return True
    try:
        qc = json.loads((folder / "config.json").read_text(encoding="utf-8")).get("quantization_config")
    except (OSError, ValueError, AttributeError):
        return False
    return isinstance(qc, dict) and qc.get("quant_method") == "cpumla"


def check_target(out, *, force: bool, reading=()) -> Path:
    """The real path to write the folder `out` to. Raises CpumlaError where writing it could destroy what
    is not ours (module docstring); `reading`: the folders of the checkpoints being read."""
    given = Path(out)
    if os.path.lexists(given) and not force:
        raise CpumlaError(f"{given} exists (pass --force to replace it)")
    target = Path(os.path.realpath(given))
    cwd = Path(os.path.realpath(os.getcwd()))
    if target == target.parent:
        raise CpumlaError(f"{given}: refusing to write over the root folder")
    if target == cwd or target in cwd.parents:
        raise CpumlaError(f"{given} is the current folder or one above it: choose a new folder to write")
    for src in reading:
        s = Path(os.path.realpath(src))
        if target == s or target in s.parents or s in target.parents:
            raise CpumlaError(f"{given} overlaps the checkpoint being read ({src}): choose another folder")
    if target.exists():
        if not target.is_dir():
            raise CpumlaError(f"{given} exists and is not a folder")
        if os.path.ismount(target):
            raise CpumlaError(f"{given} is a mount point: choose a folder inside it")
        if any(target.iterdir()) and not written_by_cpumla(target):
            raise CpumlaError(f"{given} holds files cpumla did not write: remove them yourself or choose another "
                              f"folder")
    if not target.parent.is_dir():
        raise CpumlaError(f"{target.parent}: no such folder")
    return target


@contextmanager
def staged_folder(target: Path, *, force: bool, reading=()):
    """Yields a hidden folder beside `target` (from check_target) to write into; on leaving without an
    error it becomes `target` (checked again: the file system may have changed meanwhile), replacing
    the old one as the module docstring says. On an error the partial folder is removed and the
    target left as it was. OSError becomes CpumlaError."""
    tmp = target.parent / f".{target.name}.partial-{os.getpid()}"
    try:
        if tmp.exists():                 # this process's own leftover, by its name
            shutil.rmtree(tmp)
        tmp.mkdir()
        (tmp / MARK).write_text("written by cpumla: `--force` may replace this folder\n")
        yield tmp
        check_target(target, force=force, reading=reading)
        _replace(tmp, target)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CpumlaError(f"{target}: writing failed: {e.strerror or e} (nothing was changed there)") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _replace(tmp: Path, target: Path) -> None:
    old = None
    if target.exists():
        old = target.parent / f".{target.name}.old-{os.getpid()}"
        os.rename(target, old)
    try:
        os.rename(tmp, target)
    except OSError:
        if old is not None:
            os.rename(old, target)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
