"""`python -m prequant` and the `prequant` console script.

SIGINT and SIGTERM are handled from the first line on, before the command's imports (typer, then torch: seconds
on a cold machine): a signal at any moment ends the process with one line on stderr and exit status 130 or 143.
"""

from __future__ import annotations

import atexit
import os
import sys
from types import ModuleType

from .util import trace  # noqa: F401 - first, so a trace's "start" is the process' own start (standard library only)
from .bnb import importing
from .util import signals


def main() -> None:
    """Run the `prequant` command line (see `prequant.cli`)."""
    signals.install()
    importing.lean()  # this process is the command's own: no other code here uses bitsandbytes
    try:
        from . import cli
    except KeyboardInterrupt as interrupt:  # while importing: nothing was written yet, so nothing to clean up
        signum = signals.of(interrupt)
        print(f"Error: interrupted by {signals.name(signum)}", file=sys.stderr)
        raise SystemExit(signals.exit_code(signum)) from None
    _run(cli)


def _run(cli: ModuleType) -> None:
    """`cli.main()`, then leave at once with its status.

    Once the command has finished, its output flushed and the atexit handlers (the trace, logging) run, nothing is
    left to do: the interpreter's own teardown would still spend seconds freeing torch's and transformers' modules,
    so the process exits without it. SIGINT and SIGTERM are blocked from then on, so the
    exit status is the command's, and a signal whose exception some library swallowed still makes it 130 / 143."""
    try:
        cli.main()
        code = 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt as e:  # a signal while main() was reporting how the command ended
        code = cli.interrupted(signals.of(e))
    signals.hold()
    if code == 0 and signals.received() is not None:  # a library swallowed its exception: still not a success
        code = cli.interrupted(signals.received())
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more can be said there anyway
            pass
    os._exit(code)


if __name__ == "__main__":
    main()
