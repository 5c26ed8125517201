"""The one exception type cpumla raises for problems a user can fix (bad input, unsupported CPU)."""


class CpumlaError(Exception):
    """A clear, one-line message naming the file, field or setting at fault."""
