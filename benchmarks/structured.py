"""The cost of constrained decoding per token: llguidance's token mask over DeepSeek's 129,280-id
vocabulary (computed, then applied to the logits as chat/constraint.py does), for a JSON schema with
nested objects, arrays and enums, a free-form JSON object, and a V3 tool call. Each grammar is walked
token by token along text it accepts (a valid document, tokenized as the model would write it), and the
mask of every step is timed. Prints p50 / p99 / max per grammar, and the one-off costs (the tokenizer's
conversion, the grammar's compilation).

    python3 benchmarks/structured.py [--repeat 20]
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import numpy as np

from cpumla.chat.constraint import Constraint, lark_grammar, ll_tokenizer, schema_grammar
from cpumla.chat.tokenizer import Tokenizer
from cpumla.chat.tools import JSON_STYLE, Tool, ToolCall, ToolFormat, closed

VOCAB = 129280
NESTED = {"type": "object", "required": ["name", "tags", "owner", "items"],
          "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}},
                         "owner": {"type": "object", "properties": {"id": {"type": "integer"}, "admin": {"type": "boolean"}}},
                         "items": {"type": "array", "items": {"type": "object", "properties": {
                             "sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}}}}}}
DOC = {"name": "A fairly long product name, with punctuation; and more words", "tags": ["a", "c", "b"],
       "owner": {"id": 1234567, "admin": False},
       "items": [{"sku": f"SKU-{i:04d}", "qty": i + 1} for i in range(12)]}
WEATHER = Tool("get_weather", "Weather", {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "units": {"enum": ["c", "f"]}}, "required": ["city"]})


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def walk(tok, grammar: str, ids: list[int]) -> list[float]:
    c = Constraint(tok, VOCAB, grammar)
    logits = np.zeros(VOCAB, np.float32)
    times = []
    for t in ids:
        t0 = time.perf_counter()
        masked = c.apply(logits)
        times.append(time.perf_counter() - t0)
        assert np.isfinite(masked[t]), f"the grammar refuses token {t} ({tok.decode([t])!r})"
        c.advance(t)
    assert c.accepting
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=20, help="walks per grammar")
    args = ap.parse_args()
    tok = Tokenizer.bundled()
    t0 = time.perf_counter()
    ll_tokenizer(tok, VOCAB)
    convert = time.perf_counter() - t0
    call = ToolFormat("deepseek-v3").render_calls([ToolCall("get_weather", json.dumps(
        {"city": "San Francisco", "days": 5, "units": "f"}))])
    cases = [("json_schema (nested)", schema_grammar(closed(NESTED), JSON_STYLE), json.dumps(DOC)),
             ("json_object", schema_grammar({"type": "object"}, JSON_STYLE), json.dumps(DOC)),
             ("V3 tool call", lark_grammar(ToolFormat("deepseek-v3").grammar([WEATHER], tok.token_id, False)), call)]
    print(f"# {cpu_name()}, llguidance mask + apply over {VOCAB} ids; tokenizer conversion {convert * 1e3:.0f} ms (once)")
    print(f"{'grammar':24} {'tokens':>6} {'compile ms':>10} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8}")
    for name, grammar, text in cases:
        ids = tok.encode(text)
        t0 = time.perf_counter()
        Constraint(tok, VOCAB, grammar)
        compile_ms = (time.perf_counter() - t0) * 1e3
        times = np.array([x for _ in range(args.repeat) for x in walk(tok, grammar, ids)]) * 1e3
        print(f"{name:24} {len(ids):6d} {compile_ms:10.2f} {np.percentile(times, 50):8.3f} "
              f"{np.percentile(times, 99):8.3f} {times.max():8.3f}")


if __name__ == "__main__":
    main()
