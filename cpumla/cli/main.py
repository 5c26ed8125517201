"""The `cpumla` command: a thin Typer layer over the library. Errors a user can fix print one line
and exit non-zero; no tracebacks."""

from __future__ import annotations

import sys

import typer
import typer.core

from cpumla.errors import CpumlaError


def _no_value(opt):
    """--help as our flags show: without a `<bool>` value, which a flag does not take."""
    if opt is not None:
        opt.metavar = ""
    return opt


class _Command(typer.core.TyperCommand):
    def get_help_option(self, ctx):
        return _no_value(super().get_help_option(ctx))


class _Group(typer.core.TyperGroup):
    def get_help_option(self, ctx):
        return _no_value(super().get_help_option(ctx))


app = typer.Typer(
    name="cpumla",
    cls=_Group,
    help="Run DeepSeek MLA-family models (V2, V3, V3.2, V4, Moonlight) on the CPU alone.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    """--version: the package's version, checked against the kernel library built into it (a stale
    in-place build would run other C code than the Python expects)."""
    if not value:
        return
    from cpumla import __version__
    from cpumla.cli.render import out

    try:
        from cpumla.native import ffi, lib
    except Exception:  # the library is missing or does not load: say so in one line
        raise CpumlaError(f"cpumla {__version__}: its kernel library is not built (pip install .)") from None
    built = ffi.string(lib.cpumla_version()).decode()
    if built != __version__:
        raise CpumlaError(f"cpumla {__version__}, but its kernel library was built from {built}: rebuild it "
                          f"(pip install ., or python3 setup.py build_ext --inplace)")
    out.print(f"cpumla {__version__}", markup=False, highlight=False)
    raise typer.Exit()


@app.callback()
def _main(version: bool = typer.Option(False, "--version", metavar="", is_eager=True, callback=_version,
                                       help="Print the version (checked against the kernel library) and exit.")):
    pass


def _register() -> None:
    from cpumla.cli import bench, chat, download, info, local, quantize, serve, smoke
    from cpumla.cli.options import checked

    for name, fn, text in [
        ("info", info.info, "CPU, detected features, chosen kernel implementations, build flags."),
        ("smoke", smoke.smoke, "Run models end to end (dummy or real weights) and check the logits."),
        ("bench", bench.bench, "Benchmarks: --kernels measures each GEMV format against memory bandwidth."),
        ("chat", chat.chat, "Chat with a model in the terminal (or answer one prompt with -p / stdin)."),
        ("serve", serve.serve, "An OpenAI-compatible HTTP server (chat and completions, streaming)."),
        ("download", download.download, "Download a model's config, tokenizer and safetensors (or REPO:QUANT, one GGUF quantization) into the HF cache."),
        ("list", local.list_models, "Models here: the Hugging Face cache's, folders `cpumla quantize` wrote (in DIR), "
                                    "the bundled presets; with sizes and how each is removed."),
        ("rm", local.rm, "Remove a model from the Hugging Face cache (asks first; --yes does not)."),
        ("quantize", quantize.quantize, "Write a checkpoint with q8 / q4 linear layers (loads zero-copy)."),
    ]:
        app.command(name, help=text, cls=_Command)(checked(fn))


_register()


def main(argv: list[str] | None = None) -> None:
    from cpumla.cli.render import print_error

    try:
        app(args=argv, standalone_mode=True)
    except CpumlaError as e:
        print_error(str(e))
        sys.exit(2)
    except KeyboardInterrupt:
        print_error("interrupted")
        sys.exit(130)


if __name__ == "__main__":
    main()
