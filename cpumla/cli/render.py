"""All terminal rendering of the CLI (rich). Results go to stdout, messages and stats to stderr.

User-controlled text (paths, repo ids, override keys, tensor names: anything inside an error) is never
parsed as Rich markup and always printed on one line: `one_line` escapes control characters (newlines,
ESC sequences), and the helpers below hand rich Text objects, not markup strings. `escape` is for the
rare caller that composes markup around such text."""

from __future__ import annotations

import json
import os
import sys
import unicodedata
from contextlib import contextmanager

from rich import box
from rich.console import Console
from rich.markup import escape as _markup_escape
from rich.table import Table
from rich.text import Text


def is_terminal(stream) -> bool:
    try:
        return stream is not None and stream.isatty()
    except (ValueError, OSError):          # a closed stream
        return False


# Wide enough for the tables when stdout is a pipe or a file (rich would assume 80 columns), unless
# COLUMNS says how wide.
out = Console(highlight=False, width=None if is_terminal(sys.stdout) or os.environ.get("COLUMNS", "").isdigit()
              else 160)
err = Console(stderr=True, highlight=False)

_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def one_line(text) -> str:
    """str(text) with control characters (C0, DEL, C1, line and paragraph separators) as visible
    escapes, so that nothing a file or a user named can move the cursor or start a new line."""
    s = str(text)
    if s.isprintable():
        return s
    return "".join((_NAMED.get(c) or (f"\\x{ord(c):02x}" if ord(c) < 256 else f"\\u{ord(c):04x}"))
                   if unicodedata.category(c) in ("Cc", "Cf", "Zl", "Zp") else c for c in s)


def escape(text) -> str:
    """User text made safe to embed in a markup string: one line, markup brackets escaped."""
    return _markup_escape(one_line(text))


def _print(console: Console, *parts) -> None:
    try:
        console.print(Text.assemble(*parts), soft_wrap=True, highlight=False)
    except (OSError, ValueError):          # a closed or broken stream: nowhere left to say anything
        pass


def print_error(msg) -> None:
    _print(err, ("error:", "bold red"), " ", one_line(msg))


def print_warning(msg) -> None:
    _print(err, ("warning:", "yellow"), " ", one_line(msg))


def print_line(text, style: str | None = None) -> None:
    """One result line on stdout, printed as given (no markup)."""
    _print(out, (one_line(text), style or ""))


def print_wrapped(text) -> None:
    """A result paragraph on stdout, as given (no markup), wrapped at the terminal's width."""
    try:
        out.print(Text(one_line(text)), highlight=False)
    except (OSError, ValueError):
        pass


def print_json(obj) -> None:
    sys.stdout.write(json.dumps(obj, indent=2) + "\n")


def table(title: str | None, columns: list[str], rows: list[list[str]], right: set[int] = frozenset(),
          header: bool = True, compact: bool = False, keep: set[int] = frozenset()) -> None:
    """compact: two spaces between columns and a rule under the header, no vertical lines (for a table
    that must fit 80 columns); keep: columns whose cells are never cut or wrapped (their headers may
    wrap at spaces; the other columns give way)."""
    t = Table(title=title, title_justify="left", show_edge=False, pad_edge=False, show_header=header,
              **(dict(box=box.SIMPLE_HEAD, collapse_padding=True) if compact else {}))
    cells = [[Text(one_line(v)) for v in r] for r in rows]
    for i, c in enumerate(columns):
        t.add_column(Text(one_line(c)), justify="right" if i in right else "left")
    for r in cells:
        t.add_row(*r)
    if keep and out.measure(t, options=out.options.update_width(1 << 16)).maximum > out.width:
        # too wide for the terminal: the kept columns as wide as their cells, the headers wrapped
        for i in keep:
            words = [len(w) for w in one_line(columns[i]).split()]
            t.columns[i].width = max([r[i].cell_len for r in cells] + words[:1] + [max(words, default=0)])
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
