"""Python's cyclic garbage collector paused while a phase builds many long-lived objects.

Planning a checkpoint of 100k tensors allocates millions of small objects (tensor records, decisions, output
entries, header dicts) that all stay alive, and few reference cycles. CPython's collector runs every few hundred
allocations and scans the objects that survived, so such a phase pays for rescanning its own results again and
again (docs/performance.md measures it on a DeepSeek-V3-shaped dry run). Reference counting still
frees everything acyclic at once; the collector takes the few cycles when it runs again after the phase.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def paused() -> Iterator[None]:
    """The cyclic collector off for the `with` block (and back on after it, if it was on); nestable."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
