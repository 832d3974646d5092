"""Crash points for the kill-and-resume tests: `PREQUANT_FAILPOINT=name:n` SIGKILLs the process the
n-th time it reaches `name`. A real SIGKILL, at a precise spot, which no outside timing can give.

`name:n:ACTION` does something else there: a signal name (`SIGSTOP` to freeze the process while it holds
what it holds, `SIGINT`, `SIGTERM`) is sent to the process itself, and `raise` raises an unexpected
exception (a RuntimeError, what a bug would raise). Unset (always, in normal use) this costs one dictionary
lookup."""

from __future__ import annotations

import os
import signal
import threading

from .. import settings

_spec = settings.failpoint()
_name, _, _rest = _spec.partition(":")
_count, _, _action = _rest.partition(":")
_left = {_name: int(_count or 1)} if _name else {}


def hit(name: str) -> None:
    """Act here (by default SIGKILL, no cleanup) if this is the configured point and its turn has come."""
    if name in _left:
        _left[name] -= 1
        if _left[name] == 0:
            if _action == "raise":
                raise RuntimeError(f"failure injected at {name} (PREQUANT_FAILPOINT)")
            sig = getattr(signal, _action or "SIGKILL")
            if sig in (signal.SIGKILL, signal.SIGSTOP):
                # At this thread: a signal sent to the process may land on another thread first, and this one
                # would go on for a few more steps (a shard evicted after the journal's write) before it stops.
                signal.pthread_kill(threading.get_ident(), sig)
            else:
                os.kill(os.getpid(), sig)  # handled in the main thread, whichever thread it lands on
