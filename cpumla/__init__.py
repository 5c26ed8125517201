"""cpumla: DeepSeek MLA-family language models on the CPU alone."""

__version__ = "0.1.0"

from cpumla.errors import CpumlaError  # noqa: E402

__all__ = ["CpumlaError", "__version__"]
