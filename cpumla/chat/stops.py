"""Stop strings (llama.cpp's and the OpenAI API's `stop`): generated text is held back while it could
still be the start of a stop string, and cut where one appears."""

from __future__ import annotations

from cpumla.errors import CpumlaError


def parse_stop(value) -> tuple[str, ...]:
    """A stop setting from text: "off" or "none" for none, else one string with \\n and \\t escapes."""
    if isinstance(value, (list, tuple)):
        out = tuple(value)
    else:
        text = str(value)
        out = () if text.strip().lower() in ("off", "none") else (text,)
    out = tuple(s.replace("\\n", "\n").replace("\\t", "\t") for s in out)
    if any(not s for s in out):
        raise CpumlaError("a stop string cannot be empty")
    return out


class StopText:
    """push(text) returns what may be shown now; after a stop string, `hit` names it and nothing more
    is returned. flush() releases what was held back (at the end of a stream)."""

    def __init__(self, stops=()):
        self.stops = tuple(s for s in stops if s)
        self.hit: str | None = None
        self._held = ""

    def push(self, text: str) -> str:
        if self.hit is not None:
            return ""
        if not self.stops:
            return text
        buf = self._held + text
        found = [(buf.find(s), s) for s in self.stops]
        found = [(i, s) for i, s in found if i >= 0]
        if found:
            i, self.hit = min(found)
            self._held = ""
            return buf[:i]
        hold = 0
        for s in self.stops:       # the longest end of buf that begins some stop string
            for n in range(min(len(s) - 1, len(buf)), hold, -1):
                if s.startswith(buf[-n:]):
                    hold = n
                    break
        self._held = buf[len(buf) - hold:] if hold else ""
        return buf[: len(buf) - hold]

    def flush(self) -> str:
        out, self._held = self._held, ""
        return "" if self.hit is not None else out
