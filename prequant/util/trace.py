"""Where a conversion's time goes: named timestamps and per-stage busy time, for benchmarks.

Off unless `PREQUANT_TRACE=FILE` is set; then the process writes, at exit, a JSON object with its
`events` (name -> wall-clock `time.time()`, so a parent can line them up with its own clock) and `busy`
(stage -> seconds spent inside it, summed over calls). Standard library only: the CLI imports it first.
"""

from __future__ import annotations

import atexit
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from .. import settings

_PATH = settings.trace_path()
_events: list[tuple[str, float]] = []
_busy: dict[str, float] = {}
_lock = threading.Lock()
enabled = bool(_PATH)


def mark(name: str) -> None:
    """Record that `name` happened now."""
    if enabled:
        _events.append((name, time.time()))


@contextmanager
def busy(stage: str) -> Iterator[None]:
    """Add the time spent in the block to `stage`'s total."""
    if not enabled:
        yield
        return
    t = time.perf_counter()
    try:
        yield
    finally:
        dt = time.perf_counter() - t
        with _lock:
            _busy[stage] = _busy.get(stage, 0.0) + dt


def _dump() -> None:
    mark("exit")
    try:
        with open(_PATH, "w") as f:  # type: ignore[arg-type]
            json.dump({"events": _events, "busy": {k: round(v, 3) for k, v in _busy.items()}}, f, indent=1)
    except OSError:
        pass


if enabled:
    mark("start")
    atexit.register(_dump)
