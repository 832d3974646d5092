"""How a command ends: one line on stderr and an honest exit status, whatever ended it.

0 only for success, 1 for failures, 2 for usage errors, 130 / 143 for SIGINT / SIGTERM. A PrequantError
prints its own message; anything unexpected prints its type and message in one line (PREQUANT_DEBUG=1: the
traceback instead).
"""

from __future__ import annotations

import os
import signal
import sys

import typer

from .errors import PrequantError
from .util import signals


def run(app: typer.Typer) -> None:
    """Run the typer app. A PrequantError becomes `Error: ...` on stderr with its exit code; SIGINT and SIGTERM one
    line and 130 / 143; any other exception one line and exit 1 (PREQUANT_DEBUG=1: the traceback instead)."""
    try:
        code = app(standalone_mode=False)
    except PrequantError as e:
        if os.environ.get("PREQUANT_DEBUG"):
            raise
        # One line whatever the message holds: names taken from a corrupt file may contain newlines.
        print("Error: " + _one_line(e.message), file=sys.stderr)
        sys.exit(e.exit_code)
    except KeyboardInterrupt as e:
        sys.exit(interrupted(signals.of(e)))
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except typer.Abort:
        sys.exit(1)
    except Exception as e:
        # typer raises the click it runs on: the click package, or (typer >= 0.2x) its own vendored copy.
        click_exceptions = sys.modules[typer.BadParameter.__module__]
        if isinstance(e, click_exceptions.ClickException):  # usage errors and the like
            e.show()
            sys.exit(e.exit_code)
        if os.environ.get("PREQUANT_DEBUG"):
            raise
        what = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        print(f"Error: {_one_line(what)} (PREQUANT_DEBUG=1 shows the traceback)", file=sys.stderr)
        sys.exit(1)
    if code == _TYPER_INTERRUPTED:
        # typer turns a KeyboardInterrupt inside a command into this exit code, and returns it.
        sys.exit(interrupted(signals.received() or signal.SIGINT))
    if isinstance(code, int) and code:
        sys.exit(code)


_TYPER_INTERRUPTED = 130


def interrupted(signum: int) -> int:
    """Say that a signal stopped the command; return its exit status."""
    print(f"Error: interrupted by {signals.name(signum)}", file=sys.stderr)
    return signals.exit_code(signum)


def _one_line(text: str, limit: int = 1000) -> str:
    line = " ".join(text.splitlines())
    return line if len(line) <= limit else line[: limit - 3] + "..."
