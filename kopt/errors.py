"""Errors the CLI turns into a one-line message and an exit code."""


class UsageError(Exception):
    """Bad input from the user (exit 2)."""


class RunFailed(Exception):
    """The run could not produce a result, e.g. the baseline does not compile (exit 1)."""
