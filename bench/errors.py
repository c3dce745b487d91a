"""The error every layer raises for bad user input; the CLI prints it and exits with code 2."""

from __future__ import annotations


class UsageError(ValueError):
    """Bad user input: the CLI prints it and exits with code 2."""
