"""`cpumla serve MODEL`: an OpenAI-compatible HTTP server (cpumla.server) run by uvicorn."""

from __future__ import annotations

import ipaddress
import logging
import socket
import sys

import typer

from cpumla.cli import render
from cpumla.cli.options import DRAFT_HELP, DRAFT_MODEL_HELP, DRAFT_TOKENS_HELP, MEMORY_HELP, QUANT_HELP, TP_HELP
from cpumla.errors import CpumlaError


def serve(
    model: str = typer.Argument(..., help="Model dir, cached repo id, or preset (presets need --dummy-weights)."),
    dummy_weights: bool = typer.Option(False, "--dummy-weights", metavar="", help="Deterministic random weights."),
    hf_overrides: str = typer.Option(None, "--hf-overrides", help="JSON merged into the config (as vLLM)."),
    dummy_dtype: str = typer.Option("bf16", "--dummy-dtype", help="bf16 or fp8 (FP8 block-scaled linears)."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (0.0.0.0: every interface)."),
    port: int = typer.Option(8000, "--port", help="Port (0: any free port; the one chosen is printed)."),
    api_key: str = typer.Option(None, "--api-key", envvar="CPUMLA_API_KEY",
                                help="Require 'Authorization: Bearer KEY' on every request."),
    ctx_size: int = typer.Option(None, "--ctx-size", "-c", help="Context size in tokens. Default: min(model's, 4096)."),
    threads: int = typer.Option(None, "--threads", "-t", help="Threads (default: one per core)."),
    seed: int = typer.Option(None, "--seed", help="Dummy weights' seed (default 0) and the sampling seed of "
                             "requests without their own."),
    max_queue: int = typer.Option(8, "--max-queue", help="Requests waiting for the engine before 503s."),
    tokenizer: str = typer.Option(None, "--tokenizer", help="A directory with tokenizer.json, or 'bundled'."),
    quant: str = typer.Option(None, "--quant", help=QUANT_HELP),
    memory: str = typer.Option(None, "--memory", metavar="SIZE", help=MEMORY_HELP),
    served_model_name: list[str] = typer.Option(None, "--served-model-name", metavar="NAME",
                                                help="Name clients use in 'model' (repeatable: aliases; the "
                                                     "first is reported). Default: MODEL as given."),
    cors: list[str] = typer.Option(None, "--cors", metavar="ORIGIN",
                                   help="Let browsers at ORIGIN call the API (repeatable; '*' for any)."),
    draft: str = typer.Option(None, "--draft", metavar="mtp|ngram|none", help=DRAFT_HELP),
    draft_tokens: int = typer.Option(1, "--draft-tokens", help=DRAFT_TOKENS_HELP),
    draft_model: str = typer.Option(None, "--draft-model", "-md", metavar="FILE", help=DRAFT_MODEL_HELP),
    tp: int = typer.Option(None, "--tp", metavar="N", help=TP_HELP),
) -> None:
    import uvicorn

    from cpumla.cli.options import apply_tp, check_draft, check_quant, parse_size

    from cpumla.cli.overrides import parse_hf_overrides
    from cpumla.server.app import create_app
    from cpumla.server.model import load_served

    check_quant(quant)
    check_draft(draft, draft_tokens, draft_model)
    apply_tp(tp)
    budget = parse_size(memory)       # the numeric options: cli/options.py's RULES, before this runs
    if api_key is not None and not api_key.strip():
        raise CpumlaError("--api-key is empty")
    overrides = parse_hf_overrides(hf_overrides)
    aliases = tuple(served_model_name or ())
    if any(not n.strip() for n in aliases):
        raise CpumlaError("--served-model-name is empty")
    for origin in cors or ():
        if origin != "*" and not origin.startswith(("http://", "https://")):
            raise CpumlaError(f"--cors {origin}: an origin is '*' or scheme://host[:port], e.g. http://localhost:3000")
    sock = _listen(host, port)
    with render.loading(f"loading {model}", quant) as progress:
        served, notices = load_served(model, dummy_weights=dummy_weights, hf_overrides=overrides,
                                      dummy_dtype=dummy_dtype, seed=seed or 0, threads=threads, ctx=ctx_size,
                                      tokenizer=tokenizer, quant=quant, progress=progress, memory=budget,
                                      aliases=aliases, draft=(draft, draft_tokens, draft_model))
    for n in notices:
        render.err.print(f"note: {n}", style="yellow", markup=False, highlight=False, soft_wrap=True)
    if api_key is None and not _loopback(host):
        render.err.print(f"note: listening on {host} without --api-key: anyone who can reach it can use it",
                         style="yellow", markup=False, highlight=False, soft_wrap=True)

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%Y-%m-%d %H:%M:%S",
                        stream=sys.stderr)
    runners: list = []
    app = create_app(served, api_key=api_key, max_queue=max_queue, seed=seed, runner_ref=runners,
                     cors=[o.rstrip("/") for o in cors or ()])
    addr = sock.getsockname()
    shown = f"[{addr[0]}]" if sock.family == socket.AF_INET6 else addr[0]
    think = ("always thinks" if served.fmt.always_thinks else
             "thinking off unless asked" if served.fmt.think_switch else "no thinking mode")
    render.err.print(f"cpumla serve: {served.name}{' (dummy weights)' if dummy_weights else ''} · {served.fmt.family} "
                     f"({think}) · context {served.ctx} · queue {max_queue}"
                     f"{' · API key required' if api_key else ''}", markup=False, highlight=False, soft_wrap=True)

    class Server(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            if self.started:             # the socket listens now: a client may connect at once
                render.err.print(f"listening on http://{shown}:{addr[1]}/v1", markup=False, highlight=False,
                                 soft_wrap=True)

        def handle_exit(self, sig, frame) -> None:
            for r in runners:
                r.cancel_all()           # the running answer stops at its next token
            super().handle_exit(sig, frame)

    config = uvicorn.Config(app, log_config=None, log_level="warning", access_log=False, lifespan="on",
                            timeout_graceful_shutdown=5, server_header=False)
    try:
        Server(config).run(sockets=[sock])
    except KeyboardInterrupt:        # Ctrl-C: uvicorn has shut down gracefully, then re-raised it
        pass
    finally:
        served.engine.close()
    render.err.print("cpumla serve: stopped", markup=False, highlight=False)


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _listen(host: str, port: int) -> socket.socket:
    """A bound socket (uvicorn listens on it), so that a port in use is a one-line error before the
    model loads."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise CpumlaError(f"--host {host}: {e.strerror}") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise CpumlaError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    return sock
