"""Exit codes of the `testbed` commands and the error that carries one. A module of its own so that library
code (benchmarks, experiments) can raise a command's error without importing the command line itself."""

from __future__ import annotations

EXIT_OK, EXIT_FAIL, EXIT_INPUT, EXIT_CAPABILITY = 0, 1, 2, 3


class CliError(Exception):
    """A command failed in a way its message explains fully; `code` is the exit status (EXIT_*)."""

    def __init__(self, msg: str, code: int = EXIT_FAIL):
        super().__init__(msg)
        self.code = code


class CapabilityMissing(RuntimeError):
    """The kernel or the system lacks something a topology asks for; the message says exactly what (exit code
    EXIT_CAPABILITY)."""
