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
from dataclasses import dataclass

HANDLED = (signal.SIGINT, signal.SIGTERM)


@dataclass
class _State:
    """The process' signal handling (signals are the process', so is this)."""

    received: int | None = None  # the first signal the installed handler received
    deferring: bool = False  # inside `deferred()`: a signal is recorded, not raised


_state = _State()


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
    return _state.received


def _handler(signum: int, frame: object) -> None:
    if _state.received is not None:
        # A second signal while the first unwinds: whoever sends it wants the process gone now.
        os.write(2, f"Error: interrupted by {name(signum)}\n".encode())
        os._exit(exit_code(signum))
    _state.received = signum
    if not _state.deferring:
        raise Signalled(signum)


def check() -> None:
    """Raise `Signalled` now if a signal arrived and its exception was swallowed: an import that catches
    everything would otherwise let the command run on to exit status 0."""
    if _state.received is not None:
        raise Signalled(_state.received)


@contextmanager
def deferred() -> Iterator[None]:
    """Around imports of compiled modules (torch, bitsandbytes): a signal is only recorded there, and raised as
    `Signalled` when the block ends. Raised inside, the exception could cross a C++ frame that cannot carry it
    (pybind11 then aborts the process: "terminate called after throwing an instance of
    'pybind11::error_already_set'", instead of exit status 130 / 143). A second signal still ends the process
    at once. Off the main thread it does nothing: signals are handled in the main thread only, so
    they never raise inside another thread's import (which must not delay or take the main thread's)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    outer, _state.deferring = _state.deferring, True
    try:
        yield
    finally:
        _state.deferring = outer
    if not outer:
        check()


def install() -> None:
    """Raise `Signalled` on SIGINT and SIGTERM in this process (main thread only, as Python requires)."""
    _state.received = None  # a new command (in-process callers may run several)
    for signum in HANDLED:
        signal.signal(signum, _handler)


def raising(signum: int, frame: object) -> None:
    """A plain handler raising `Signalled` every time (what a library installs for the span of a call)."""
    raise Signalled(signum)


def hold() -> None:
    """Block both signals from now on: the command has finished, and its exit status says how."""
    signal.pthread_sigmask(signal.SIG_BLOCK, set(HANDLED))
