"""Cache reuse across turns, shared by `cpumla chat` (conversation.py) and `cpumla serve`: a new prompt is
tokenized as the text the cache already holds (the model's own answer tokens, not a re-tokenization of
their text) followed by the fresh text, and the engine keeps its longest common prefix with it."""

from __future__ import annotations

Pieces = list[tuple[str, list[int]]]     # text with a known tokenization, cut at added tokens


def answer_pieces(tok, ids: list[int]) -> Pieces:
    """Generated ids as (text, ids) pieces, cut at added tokens."""
    pieces, run = [], []
    for t in ids:
        if t in tok.added_ids:
            if run:
                pieces.append((tok.decode(run), run))
                run = []
            pieces.append((tok.decode([t]), [t]))
        else:
            run.append(t)
    if run:
        pieces.append((tok.decode(run), run))
    return pieces


def prompt_pieces(tok, known: Pieces, text: str) -> Pieces:
    """`text` as pieces: the known pieces it starts with, then the rest encoded piece by piece between
    added tokens."""
    pos, pieces = 0, []
    for piece, ids in known:
        if not text.startswith(piece, pos):
            break
        pieces.append((piece, ids))
        pos += len(piece)
    return pieces + [(p, tok.encode(p)) for p in tok.split_added(text[pos:])]


def ids_of(pieces: Pieces) -> list[int]:
    return [i for _, ids in pieces for i in ids]


def sync_cache(engine, ids: list[int]) -> int:
    """Truncates the engine's cache to its longest common prefix with ids, leaving at least one token to
    run; returns that prefix length."""
    have = engine.tokens[: min(engine.pos, len(engine.tokens))]
    n = 0
    for a, b in zip(have, ids):
        if a != b:
            break
        n += 1
    n = min(n, len(ids) - 1)
    engine.truncate(n)
    return n
