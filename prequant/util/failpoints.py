"""Crash points for the kill-and-resume tests: `PREQUANT_FAILPOINT=name:n` SIGKILLs the process the
n-th time it reaches `name`. A real SIGKILL, at a precise spot, which no outside timing can give.
Unset (always, in normal use) this costs one dictionary lookup."""

from __future__ import annotations

import os
import signal

_spec = os.environ.get("PREQUANT_FAILPOINT", "")
_name, _, _count = _spec.partition(":")
_left = {_name: int(_count or 1)} if _name else {}


def hit(name: str) -> None:
    """Die here (SIGKILL, no cleanup) if this is the configured crash point and its turn has come."""
    if name in _left:
        _left[name] -= 1
        if _left[name] == 0:
            os.kill(os.getpid(), signal.SIGKILL)
