"""The weight package's error, importable without torch (the command line catches it)."""

from __future__ import annotations

from spark_bench.sweep import UsageError


class WeightError(UsageError):
    """A weight or routing file that cannot be used: the message is one line naming the file and the problem."""
