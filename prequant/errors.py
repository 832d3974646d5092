"""prequant's one error type: what went wrong, why, and how to fix it, as one line."""

from __future__ import annotations


class PrequantError(Exception):
    """An error meant for the user: one line saying what, why and the fix.

    The CLI prints it as ``Error: <message>`` on stderr and exits with ``exit_code``
    (1 for failures, 2 for usage errors), with no traceback unless PREQUANT_DEBUG=1.
    """

    exit_code = 1

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class UsageError(PrequantError):
    """The command line or the options are wrong (exit code 2)."""

    exit_code = 2


class Interrupted(PrequantError):
    """SIGINT or SIGTERM stopped a conversion; the work done so far is kept for --resume."""

    def __init__(self, signal_name: str, exit_code: int) -> None:
        super().__init__(
            f"interrupted by {signal_name}; the work done so far is kept: rerun the same command with --resume "
            "to continue"
        )
        self.exit_code = exit_code
