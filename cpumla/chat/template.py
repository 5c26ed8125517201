"""Chat templates from a model's tokenizer_config.json, rendered in a bounded jinja2 sandbox: the
settings transformers uses (ImmutableSandboxedEnvironment, trim_blocks, lstrip_blocks,
raise_exception, tojson), plus limits a template file cannot get around: range() and sequence
repetition share one budget of items per render, the output is capped in size, and rendering stops
after RENDER_SECONDS. Any failure (syntax, a runtime error, a limit) is one CpumlaError line."""

from __future__ import annotations

import json
import time

from cpumla.errors import CpumlaError

MAX_ITEMS = 1_000_000          # range() items and repeated-sequence length, all together, per render
MAX_OUTPUT = 16 << 20          # characters of rendered prompt
RENDER_SECONDS = 5.0


class _Budget(Exception):
    pass


def compile_template(template: str):
    """A render(**variables) -> str function for the template. Raises CpumlaError when it does not compile."""
    try:
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise CpumlaError("this model's chat_template needs jinja2 (pip install jinja2)") from None

    state = {"items": 0, "deadline": 0.0}

    def spend(n: int) -> None:
        state["items"] += max(0, int(n))
        if state["items"] > MAX_ITEMS:
            raise _Budget(f"the template iterates or repeats more than {MAX_ITEMS} items")
        if time.monotonic() > state["deadline"]:
            raise _Budget(f"the template ran longer than {RENDER_SECONDS:g} s")

    def bounded_range(*args):
        r = range(*args)
        spend(len(r))
        return _TimedRange(r, state)

    class Env(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset(["*", "**"])

        def call_binop(self, context, operator, left, right):
            if operator == "**" and isinstance(right, (int, float)) and abs(right) > 64:
                raise _Budget("the template raises a number to a power above 64")
            if operator == "*":
                for seq, n in ((left, right), (right, left)):
                    if isinstance(seq, (str, list, tuple)) and isinstance(n, int):
                        spend(len(seq) * n)
            return super().call_binop(context, operator, left, right)

    def raise_exception(message):
        raise CpumlaError(f"chat_template: {message}")

    env = Env(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    env.globals["range"] = bounded_range
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    try:
        tpl = env.from_string(template)
    except Exception as e:        # TemplateSyntaxError and friends
        raise CpumlaError(f"chat_template does not compile: {_one_line(e)}") from None

    def render(**variables) -> str:
        state["items"], state["deadline"] = 0, time.monotonic() + RENDER_SECONDS
        out, size = [], 0
        try:
            for chunk in tpl.generate(**variables):
                size += len(chunk)
                if size > MAX_OUTPUT:
                    raise _Budget(f"the template's output passed {MAX_OUTPUT} characters")
                if time.monotonic() > state["deadline"]:
                    raise _Budget(f"the template ran longer than {RENDER_SECONDS:g} s")
                out.append(chunk)
        except CpumlaError:
            raise
        except _Budget as e:
            raise CpumlaError(f"chat_template stopped: {e}") from None
        except Exception as e:    # a jinja runtime error, or the sandbox refusing an operation
            raise CpumlaError(f"chat_template: {type(e).__name__}: {_one_line(e)}") from None
        return "".join(out)

    return render


class _TimedRange:
    """A range whose iteration checks the render's deadline every 4096 items (nested loops that
    write nothing never reach the output check)."""

    def __init__(self, r: range, state: dict):
        self.r, self.state = r, state

    def __iter__(self):
        deadline = self.state["deadline"]
        for i, v in enumerate(self.r):
            if not i & 4095 and time.monotonic() > deadline:
                raise _Budget(f"the template ran longer than {RENDER_SECONDS:g} s")
            yield v

    def __len__(self):
        return len(self.r)

    def __getitem__(self, i):
        return self.r[i]

    def __contains__(self, v):
        return v in self.r


def _one_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__
