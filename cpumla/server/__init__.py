"""`cpumla serve`: an OpenAI-compatible HTTP server over one engine (Starlette + uvicorn).

protocol.py  the wire format: request checks, errors in OpenAI's shape, response and chunk objects
model.py     the served model: prompts (chat format, prefix reuse), generation on the worker thread
app.py       the ASGI app: routes, API key, per-request log line, the one-engine scheduler
"""
