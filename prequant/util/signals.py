"""SIGINT and SIGTERM as one exception, so that every command stops the same way at any moment.

The `prequant` command calls `install()` first thing, before anything heavy is imported; from then on either
signal raises `Signalled` in the main thread. It is a KeyboardInterrupt: code that already cleans up after
Ctrl-C (joins its threads, flushes the resume journal) does the same for SIGTERM, and no `except Exception`
in a library can swallow it. A second signal while the first is still unwinding ends the process at once.
Standard library only.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

HANDLED = (signal.SIGINT, signal.SIGTERM)
_received: int | None = None
_deferring = False


class Signalled(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived (raised in the main thread by the handler)."""

    def __init__(self, signum: int) -> None:
        super().__init__(name(signum))
        self.signum = signum


def name(signum: int) -> str:
    """'SIGINT', 'SIGTERM'."""
    return signal.Signals(signum).name


def exit_code(signum: int) -> int:
    """What a shell reports for a process the signal ended: 130 for SIGINT, 143 for SIGTERM."""
    return 128 + signum


def of(interrupt: BaseException) -> int:
    """The signal behind a KeyboardInterrupt: its own for `Signalled`, else SIGINT (Python's Ctrl-C)."""
    return getattr(interrupt, "signum", signal.SIGINT)


def received() -> int | None:
    """The first signal the installed handler received, if any."""
    return _received


def _handler(signum: int, frame: object) -> None:
    global _received
    if _received is not None:
        # A second signal while the first unwinds: whoever sends it wants the process gone now.
        os.write(2, f"Error: interrupted by {name(signum)}\n".encode())
        os._exit(exit_code(signum))
    _received = signum
    if not _deferring:
        raise Signalled(signum)


def check() -> None:
    """Raise `Signalled` now if a signal arrived and its exception was swallowed: an import that catches
    everything (measured: SIGTERM during torch's imports, the conversion then ran to exit status 0)."""
    if _received is not None:
        raise Signalled(_received)


@contextmanager
def deferred() -> Iterator[None]:
    """Around imports of compiled modules (torch, bitsandbytes): a signal is only recorded there, and raised as
    `Signalled` when the block ends. Raised inside, the exception would cross a C++ frame that cannot carry it
    (pybind11: "terminate called after throwing an instance of 'pybind11::error_already_set'", measured on
    torch.distributed's import: the process aborted instead of exiting 130 / 143). A second signal still ends
    the process at once. Off the main thread it does nothing: signals are handled in the main thread only, so
    they never raise inside another thread's import (which must not delay or take the main thread's)."""
    global _deferring
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    outer, _deferring = _deferring, True
    try:
        yield
    finally:
        _deferring = outer
    if not outer:
        check()


def install() -> None:
    """Raise `Signalled` on SIGINT and SIGTERM in this process (main thread only, as Python requires)."""
    global _received
    _received = None  # a new command (in-process callers may run several)
    for signum in HANDLED:
        signal.signal(signum, _handler)


def raising(signum: int, frame: object) -> None:
    """A plain handler raising `Signalled` every time (what a library installs for the span of a call)."""
    raise Signalled(signum)


def hold() -> None:
    """Block both signals from now on: the command has finished, and its exit status says how."""
    signal.pthread_sigmask(signal.SIG_BLOCK, set(HANDLED))
