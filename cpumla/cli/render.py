"""All terminal rendering of the CLI (rich). Results go to stdout, messages and stats to stderr."""

from __future__ import annotations

import json
import sys
from contextlib import contextmanager

from rich.console import Console
from rich.table import Table

# Wide enough for the tables when stdout is a pipe or a file (rich would assume 80 columns).
out = Console(highlight=False, width=None if sys.stdout.isatty() else 160)
err = Console(stderr=True, highlight=False)


def print_error(msg: str) -> None:
    err.print(f"[bold red]error:[/] {msg}", markup=True, soft_wrap=True)


def print_json(obj) -> None:
    sys.stdout.write(json.dumps(obj, indent=2) + "\n")


def table(title: str | None, columns: list[str], rows: list[list[str]], right: set[int] = frozenset(),
          header: bool = True) -> None:
    t = Table(title=title, title_justify="left", show_edge=False, pad_edge=False, show_header=header)
    for i, c in enumerate(columns):
        t.add_column(c, justify="right" if i in right else "left")
    for r in rows:
        t.add_row(*[str(v) for v in r])
    out.print(t)


@contextmanager
def loading(label: str, quant: str | None, show: bool = True):
    """A spinner on stderr while a model loads; with --quant, a bar of the quantization's progress.
    Yields the progress callback to hand to cpumla.load (None without --quant)."""
    if not show:
        yield None
        return
    if quant is None:
        with err.status(label):
            yield None
        return
    from rich.progress import BarColumn, Progress, SpinnerColumn, TaskProgressColumn, TextColumn, TimeElapsedColumn

    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(),
                  TimeElapsedColumn(), console=err, transient=True) as prog:
        task = prog.add_task(f"{label}: quantizing to {quant}", total=None)
        yield lambda done, total: prog.update(task, completed=done, total=total)
