"""`python -m prequant` and the `prequant` console script.

SIGINT and SIGTERM are handled from the first line on, before the command's imports (typer, then torch: seconds
on a cold machine): a signal at any moment ends the process with one line on stderr and exit status 130 or 143.
"""

from __future__ import annotations

import sys

from .util import trace  # noqa: F401 - first, so a trace's "start" is the process' own start (standard library only)
from .util import signals


def main() -> None:
    """Run the `prequant` command line (see `prequant.cli`)."""
    signals.install()
    try:
        from .cli import run
    except KeyboardInterrupt as interrupt:  # while importing: nothing was written yet, so nothing to clean up
        signum = signals.of(interrupt)
        print(f"Error: interrupted by {signals.name(signum)}", file=sys.stderr)
        raise SystemExit(signals.exit_code(signum)) from None
    run()


if __name__ == "__main__":
    main()
