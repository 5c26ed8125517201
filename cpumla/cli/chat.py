"""`cpumla chat MODEL`: a terminal chat that streams, or one answer with -p / a prompt on stdin.

The conversation itself (formats, cache reuse, sampling, detokenization) is cpumla.chat.conversation;
this module reads input, handles commands and Ctrl-C, and renders through cpumla.cli.render's consoles.
"""

from __future__ import annotations

import re
import signal
import sys
import time

import typer

from cpumla.cli import render
from cpumla.cli.options import DRAFT_HELP, DRAFT_MODEL_HELP, DRAFT_TOKENS_HELP, MEMORY_HELP, QUANT_HELP, TP_HELP
from cpumla.errors import CpumlaError

PROGRESS_AFTER_S = 1.0    # a prefill running longer than this shows its progress on stderr

HELP = """\
/help                      this list
/exit                      leave (also Ctrl-D, or Ctrl-C twice at the prompt)
/clear                     forget the conversation (and the cache); the system prompt stays
/system [TEXT|off]         show, set or remove the system prompt
/set [KEY VALUE]           show settings, or set one: temperature, top_p, top_k, min_p, max_tokens,
                           think (on/off), seed (none: random), repeat_penalty, repeat_last_n,
                           presence_penalty, frequency_penalty, stop (text, or off)
/stats                     cache use, the last turn's speeds, experts read from disk
/regen                     answer the last message again
\"\"\"                        start and end a multi-line message
Ctrl-C                     stop the answer being written (the conversation keeps what was written);
                           while the prompt is read, drop the message"""


def chat(
    model: str = typer.Argument(..., help="Model dir, cached repo id, or preset (presets need --dummy-weights)."),
    prompt: str = typer.Option(None, "--prompt", "-p", help="Answer this one prompt on stdout and exit."),
    system: str = typer.Option(None, "--system", "-s", help="System prompt."),
    temperature: float = typer.Option(0.6, "--temperature", help="0 is greedy."),
    top_p: float = typer.Option(0.95, "--top-p", help="Nucleus sampling: the smallest set of tokens holding this "
                                "much probability (1: off)."),
    top_k: int = typer.Option(0, "--top-k", help="0: no top-k."),
    min_p: float = typer.Option(0.0, "--min-p", help="Drop tokens below this fraction of the likeliest's "
                                "probability (0: off)."),
    repeat_penalty: float = typer.Option(1.0, "--repeat-penalty", help="Penalise the last --repeat-last-n "
                                         "tokens (llama.cpp's; 1: off)."),
    repeat_last_n: int = typer.Option(64, "--repeat-last-n", help="Tokens the repeat penalty looks back at."),
    presence_penalty: float = typer.Option(0.0, "--presence-penalty", help="OpenAI's, -2..2: tokens already "
                                           "in the answer."),
    frequency_penalty: float = typer.Option(0.0, "--frequency-penalty", help="OpenAI's, -2..2: by how often "
                                            "a token came in the answer."),
    stop: list[str] = typer.Option(None, "--stop", help="End the answer before this text (repeatable; "
                                   "\\n for a newline)."),
    seed: int = typer.Option(None, "--seed", help="Sampling seed (same seed and prompt, same answer)."),
    max_tokens: int = typer.Option(1024, "--max-tokens", "-n", help="Most tokens per answer."),
    think: bool = typer.Option(None, "--think/--no-think", metavar="",
                               help="Thinking mode (V3.1, V3.2, V4; R1 always thinks)."),
    ctx: int = typer.Option(None, "--ctx", "-c", help="Context size in tokens. Default: min(model's, 4096)."),
    tokenizer: str = typer.Option(None, "--tokenizer", help="A directory with tokenizer.json, or 'bundled'."),
    dummy_weights: bool = typer.Option(False, "--dummy-weights", metavar="", help="Deterministic random weights."),
    hf_overrides: str = typer.Option(None, "--hf-overrides", help="JSON merged into the config (as vLLM)."),
    threads: int = typer.Option(None, "--threads", "-t", help="Threads (default: one per core)."),
    quant: str = typer.Option(None, "--quant", help=QUANT_HELP),
    memory: str = typer.Option(None, "--memory", metavar="SIZE", help=MEMORY_HELP),
    draft: str = typer.Option(None, "--draft", metavar="mtp|ngram|none", help=DRAFT_HELP),
    draft_tokens: int = typer.Option(1, "--draft-tokens", help=DRAFT_TOKENS_HELP),
    draft_model: str = typer.Option(None, "--draft-model", "-md", metavar="FILE", help=DRAFT_MODEL_HELP),
    tp: int = typer.Option(None, "--tp", metavar="N", help=TP_HELP),
) -> None:
    from cpumla.chat.stops import parse_stop
    from cpumla.cli.options import apply_tp, check_draft, check_quant, check_threads, parse_size
    from cpumla.sampling import check

    check_quant(quant)
    check_draft(draft, draft_tokens, draft_model)
    apply_tp(tp)
    budget = parse_size(memory)
    interactive = prompt is None and sys.stdin.isatty()
    warnings = check_threads(threads)
    sampling = dict(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, repeat_penalty=repeat_penalty,
                    repeat_last_n=repeat_last_n, presence_penalty=presence_penalty,
                    frequency_penalty=frequency_penalty, seed=seed)
    try:
        check(**sampling)
    except CpumlaError as e:     # the library names settings; the user typed flags
        raise CpumlaError(re.sub(r"\b(" + "|".join(sampling) + r")\b",
                                 lambda m: "--" + m.group(1).replace("_", "-"), str(e))) from None
    sampling.update(max_tokens=max_tokens, stop=parse_stop(list(stop or ())))
    if not interactive:
        prompt = prompt if prompt is not None else _read_stdin()
        if not prompt.strip():
            raise CpumlaError("empty prompt (pass -p TEXT or pipe a prompt on stdin)")
    conv, info, notices = _open(model, dummy_weights, hf_overrides, seed, threads, ctx, tokenizer, system,
                                sampling, think, interactive, quant, budget, (draft, draft_tokens, draft_model))
    for n in warnings + notices:
        render.err.print(f"note: {n}", style="yellow", markup=False, highlight=False, soft_wrap=True)
    render.err.print(f"ready: {info['model']} loaded in {info['load_s']:.1f} s", style="dim", markup=False,
                     highlight=False, soft_wrap=True)
    if not interactive:
        stopped = _turn(conv, conv.send(prompt.strip()), interactive=False)
        sys.exit(130 if stopped else 0)
    _header(info)
    _loop(conv)


# ---- setup ----
def _open(model, dummy_weights, hf_overrides, seed, threads, ctx, tokenizer, system, sampling, think, interactive,
          quant=None, memory=None, draft=(None, 1, None)):
    from cpumla import native
    from cpumla.chat.chat_format import format_for
    from cpumla.chat.conversation import Conversation, Settings
    from cpumla.chat.tokenizer import load_tokenizer
    from cpumla.cli.options import check_ctx
    from cpumla.cli.overrides import parse_hf_overrides
    from cpumla.runtime.loader import load
    from cpumla.runtime.resolve import load_config
    from cpumla.runtime.speculative import mtp_source

    overrides = parse_hf_overrides(hf_overrides)
    cfg, resolved = load_config(model, overrides, mtp=mtp_source(draft[0], draft[2]))
    ctx_notes = check_ctx(ctx, cfg.max_position_embeddings)
    tok, notices = load_tokenizer(resolved, tokenizer, dummy_weights)
    if tok.vocab_size > cfg.vocab_size and "vocab_size" not in overrides:
        if dummy_weights:      # random weights fit any tokenizer: silently, as there is nothing to fix
            overrides = {**overrides, "vocab_size": tok.vocab_size}
        elif not tok.bundled:
            notices.append(f"the tokenizer has {tok.vocab_size} ids, the model {cfg.vocab_size}")
    t0 = time.perf_counter()
    with render.loading(f"loading {model}", quant, show=interactive or quant is not None) as progress:
        engine = load(model, dummy_weights=dummy_weights, hf_overrides=overrides, seed=seed or 0,
                             threads=threads, max_seq_len=ctx, quant=quant, progress=progress, resolved=resolved,
                      memory=memory, draft=draft[0], draft_tokens=draft[1],
                      draft_model=draft[2])
    load_s = time.perf_counter() - t0
    notices += ctx_notes
    fmt = format_for(cfg.model_type, resolved.name or model, tok)
    family = fmt.family
    if fmt.always_thinks:
        if think is False:
            notices.append(f"{family} always thinks; --no-think ignored")
        think_on = True
    elif fmt.think_switch:
        think_on = bool(think)
    else:
        if think is not None:
            notices.append(f"{family} has no thinking mode; --{'' if think else 'no-'}think ignored")
        think_on = False
    settings = Settings(think=think_on, **sampling)
    conv = Conversation(engine, tok, fmt, settings, system=system,
                        stop_ids=[] if tok.bundled else cfg.eos_ids)
    info = dict(model=model + (" (dummy weights)" if dummy_weights else ""), family=family,
                format=fmt.source, tokenizer=tok.source, isa=native.isa(), threads=native.get_threads(),
                ctx=engine.max_seq_len, load_s=load_s)
    return conv, info, notices


def _read_stdin() -> str:
    data = sys.stdin.buffer.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CpumlaError(f"stdin is not valid UTF-8 (byte 0x{data[e.start]:02x} at offset {e.start})") from None


# ---- rendering ----
def _header(info) -> None:
    out = render.out
    out.print(f"[bold]cpumla chat[/] · {render.escape(info['model'])}", highlight=False)
    out.print(f"[dim]family {info['family']} ({info['format']} format) · tokenizer {info['tokenizer']} · "
              f"{info['isa']} · {info['threads']} threads · context {info['ctx']}[/]", highlight=False)
    out.print('[dim]/help for commands · """ for multi-line · Ctrl-C stops an answer · Ctrl-D exits[/]',
              highlight=False)


def _write(text: str, style: str | None = None, console=None) -> None:
    (console or render.out).print(text, style=style, end="", markup=False, emoji=False, highlight=False,
                                  soft_wrap=True)


def _stats_line(st) -> str:
    cached = f", {st.cached_tokens} cached" if st.cached_tokens else ""
    s = (f"prompt {st.prompt_tokens} tok{cached}, {st.prompt_tps:.1f} tok/s · "
         f"answer {st.gen_tokens} tok, {st.gen_tps:.1f} tok/s")
    return s + {"interrupted": " · stopped", "max_tokens": " · max tokens", "context": " · context full",
                "stop": " · stop string"}.get(st.stop, "")


def progress_line(console, text: str | None) -> None:
    """One line of progress that the next overwrites, on a terminal (text None: clear it); elsewhere each
    on a line of its own. Rich drops a carriage return inside printed text, so the control codes go to the
    console's file directly."""
    if not console.is_terminal:
        if text is not None:
            console.print(text, style="dim", markup=False, highlight=False, soft_wrap=True)
        return
    console.file.write("\r\x1b[2K")
    if text is not None:
        console.print(text, style="dim", end="", markup=False, highlight=False, soft_wrap=True)
    console.file.flush()


def _turn(conv, events, interactive: bool) -> bool:
    """Stream one answer; Ctrl-C stops it. True when it was stopped by Ctrl-C."""
    previous = signal.signal(signal.SIGINT, lambda *_: conv.request_stop())
    mode, wrote, progress = None, False, False
    reasoning_console = render.out if interactive else render.err
    try:
        for ev in events:
            if ev.kind == "progress":
                if ev.seconds >= PROGRESS_AFTER_S or progress:
                    progress = True
                    rate = ev.done / ev.seconds if ev.seconds > 0 else 0.0
                    progress_line(render.err, f"reading the prompt: {ev.done} / {ev.total} tokens, {rate:.0f} "
                                              f"tok/s (Ctrl-C stops)")
                continue
            if progress:
                progress_line(render.err, None)
                progress = False
            if ev.kind == "notice":
                if wrote:
                    _write("\n")
                text = ev.text
                if interactive and conv.last.stop == "context":
                    text += "; the next turn drops the oldest turns"
                render.err.print(f"note: {text}", style="yellow", markup=False, highlight=False, soft_wrap=True)
                continue
            if ev.kind != mode and mode is not None:
                _write("\n\n", console=reasoning_console if mode == "reasoning" else None)
            mode = ev.kind
            if ev.kind == "reasoning":
                _write(ev.text, style="dim", console=reasoning_console)
            else:
                _write(ev.text)
                wrote = True
    finally:
        signal.signal(signal.SIGINT, previous)
    if mode is not None or not interactive:
        _write("\n", console=reasoning_console if (mode == "reasoning" and not wrote) else None)
    render.err.print(_stats_line(conv.last), style="dim", markup=False, highlight=False, soft_wrap=True)
    return conv.last.stop == "interrupted"


# ---- the interactive loop ----
def _loop(conv) -> None:
    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:
        pass
    try:
        sys.stdin.reconfigure(errors="surrogateescape")   # bad bytes become a message, not an exception
    except (AttributeError, ValueError):
        pass
    # Ctrl-C at the prompt is ours to handle even when the parent started us with SIGINT ignored (a
    # background job of a non-interactive shell), which Python would otherwise keep
    signal.signal(signal.SIGINT, signal.default_int_handler)
    ctrl_c = False
    while True:
        try:
            line = _read_message()
        except EOFError:
            _write("\n")
            return
        except KeyboardInterrupt:
            if ctrl_c:
                _write("\n")
                return
            ctrl_c = True
            _write("\n")
            render.err.print("(Ctrl-C again or Ctrl-D to exit)", style="dim", markup=False)
            continue
        ctrl_c = False
        if any("\udc80" <= c <= "\udcff" for c in line):
            render.print_error("input is not valid UTF-8; message ignored")
            continue
        text = line.strip()
        if not text:
            continue
        try:
            if text.startswith("/") and not text.startswith("//"):
                if _command(conv, text) == "exit":
                    return
            else:
                _turn(conv, conv.send(text[1:] if text.startswith("//") else text), interactive=True)
        except CpumlaError as e:
            render.print_error(str(e))


def _read_message() -> str:
    line = input(">>> ")
    if not line.lstrip().startswith('"""'):
        return line
    rest = line.lstrip()[3:]
    if rest.rstrip().endswith('"""') and len(rest.rstrip()) >= 3:
        return rest.rstrip()[:-3]
    lines = [rest] if rest else []
    while True:
        nxt = input("... ")
        if nxt.rstrip().endswith('"""'):
            lines.append(nxt.rstrip()[:-3])
            return "\n".join(lines)
        lines.append(nxt)


def _command(conv, text: str):
    cmd, _, arg = text.partition(" ")
    arg = arg.strip()
    cmd = cmd.lower()
    if cmd in ("/exit", "/quit", "/bye"):
        return "exit"
    if cmd in ("/help", "/?"):
        render.out.print(HELP, markup=False, highlight=False)
    elif cmd == "/clear":
        conv.clear()
        render.err.print("conversation cleared", style="dim")
    elif cmd == "/system":
        if not arg:
            render.out.print(f"system prompt: {conv.system!r}" if conv.system else "no system prompt",
                             markup=False, highlight=False)
        else:
            conv.set_system(None if arg == "off" else arg)
            render.err.print("system prompt removed" if arg == "off" else "system prompt set", style="dim")
    elif cmd == "/set":
        if not arg:
            s = conv.settings
            from cpumla.chat.conversation import SHOWN

            render.out.print("  ".join(f"{k}={getattr(s, k)!r}" if k == "stop" else f"{k}={getattr(s, k)}"
                                       for k in SHOWN), markup=False, highlight=False)
        else:
            key, _, value = arg.partition(" ")
            if not value.strip():
                raise CpumlaError(f"/set {key} needs a value")
            conv.set(key, value.strip() if key != "stop" else value.lstrip(" "))
            render.err.print(f"{key} = {getattr(conv.settings, key)!r}" if key == "stop" else
                             f"{key} = {getattr(conv.settings, key)}", style="dim", markup=False)
    elif cmd == "/stats":
        e, st = conv.engine, conv.last
        render.out.print(f"cache {len(e.tokens)} / {e.max_seq_len} tokens · {conv.turns} turn"
                         f"{'' if conv.turns == 1 else 's'} · "
                         f"{len(conv.history)} messages in history · {conv.dropped_turns} turns dropped", markup=False,
                         highlight=False)
        render.out.print(f"last turn: {_stats_line(st)}", markup=False, highlight=False)
        if e.drafter is not None:
            render.out.print(f"drafts ({e.draft}, up to {e.draft_tokens} a forward): {st.kept} of {st.drafted} kept, "
                             f"{st.gen_tokens} tokens in {st.forwards} decode forwards", markup=False, highlight=False)
        if e.stream is not None:
            s = e.stream.stats()
            render.out.print(f"routed experts: {s.slots} slots, {100 * s.hit_rate:.0f}% of {s.lookups} lookups in "
                             f"memory, {s.bytes_read / 1e9:.2f} GB read from disk at {s.read_gbps:.2f} GB/s",
                             markup=False, highlight=False)
    elif cmd == "/regen":
        _turn(conv, conv.regenerate(), interactive=True)
    else:
        raise CpumlaError(f"unknown command {cmd} (/help lists the commands; start with // to send a literal /)")
