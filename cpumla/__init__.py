"""cpumla: DeepSeek MLA-family language models on the CPU alone."""

__version__ = "0.1.0"

from cpumla.errors import CpumlaError  # noqa: E402


def load(model: str, **kwargs):
    """An Engine for a model directory, cached repo id or preset; see cpumla.runtime.loader.load."""
    from cpumla.runtime.loader import load as _load

    return _load(model, **kwargs)


__all__ = ["CpumlaError", "__version__", "load"]
