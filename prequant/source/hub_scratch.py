"""The disk a streamed Hub source's shards take during a conversion with `--delete-source-shards`, in bytes.

A conversion that deletes its downloaded shards promises to hold at most `SLOTS` times the largest shard's bytes of
them on disk at any moment (its `budget`). `Scratch` is the ledger that keeps that promise for `hub_stream`'s reader:
what each download in flight may have written so far (its grant: the whole shard, or, for a download held to a
limit, `hub.fetcher`, as much as there is room for), each downloaded shard of this run at its size less what was
freed of it (`util.holes`), and each evicted one until it is really gone (deleted, and no longer mapped or open by
this process: only then does the disk get its space back). A new download starts only once its first grant fits,
and limited downloads are given more, in plan order, as shards before them are freed (`regrant`).

Not locked by itself: the reader calls it under its own condition, the one `wait_for_room` waits on and `regrant`
notifies, so that the ledger and the reader's other state change together.
"""

from __future__ import annotations

import gc
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path

from ..hub import fetcher

log = logging.getLogger(__name__)

SLOTS = 2  # with delete, this run's shards take at most SLOTS x the largest shard's bytes of disk
# The least a download starts with: a limited download begins once this much (or the whole shard) fits, and is
# allowed more as the shards before it are freed.
GRANT_STEP = 64 << 20
_LEAK_WAIT_S = 60.0  # a deleted shard still mapped after this long is a leak: stop waiting for it


class Scratch:
    """This run's shards on disk against `budget` (module docstring); every method is called under `cond`."""

    def __init__(self, sizes: dict[Path, int], cond: threading.Condition) -> None:
        """`sizes`: every shard's bytes, in the order the plan reads them (the order grants are given in)."""
        self.sizes = sizes
        self.budget = SLOTS * max(sizes.values(), default=0)
        self.cond = cond
        self.granted: dict[Path, int] = {}  # a download in flight: the bytes it may have on disk so far
        self.limited: dict[Path, fetcher.Fetcher] = {}  # a download in flight held to its grant: by whom
        self.owned: dict[Path, Path] = {}  # downloaded by this run, still in the cache: path -> blob
        self.deleted: dict[Path, Path] = {}  # evicted or set aside by this run; on disk until gone and unmapped
        self.freed: dict[Path, int] = {}  # this run's shard: bytes given back to the disk (holes)

    def held(self, *, deleted: bool = True) -> int:
        """Bytes of disk this run's shards take: the grants of the downloads in flight, each downloaded shard's size
        less what was freed of it, and each evicted one still there (being deleted, or deleted and still mapped or
        open: its space is freed only once the last goes). Without the evicted ones where `deleted` is false."""
        if self.deleted:
            held = _held_files()
            for path, blob in list(self.deleted.items()):
                if not os.path.lexists(blob) and f"{blob} (deleted)" not in held:
                    del self.deleted[path]
                    self.freed.pop(path, None)
        shards = [*self.owned, *self.deleted] if deleted else list(self.owned)
        return sum(self.granted.values()) + sum(self.sizes[p] - self.freed.get(p, 0) for p in shards)

    def wait_for_room(self, need: int, stopped: Callable[[], bool]) -> bool:
        """Wait until `need` more bytes fit in the budget; False once `stopped()`."""
        polls = 0  # of 0.1 s, while only evicted shards still mapped or open are in the way
        while not stopped() and self.held() + need > self.budget:
            self.cond.wait(0.1)
            if self.deleted and self.held(deleted=False) + need <= self.budget:
                polls += 1
                if polls % 20 == 0:
                    gc.collect()  # a reference cycle may hold the last view
                if polls > _LEAK_WAIT_S * 10:
                    why = {str(p): "its blob is still on disk" if os.path.lexists(b) else "mapped or open here"
                           for p, b in sorted(self.deleted.items())}  # fmt: skip
                    log.warning("evicted shards still take disk space (%s); downloading on", why)
                    self.deleted.clear()
        return not stopped()

    def first_grant(self, path: Path, limited: bool) -> int:
        """What a download of `path` needs to fit before it starts: its first grant, or the whole shard."""
        return min(self.sizes[path], GRANT_STEP) if limited else self.sizes[path]

    def grant(self, path: Path, mine: fetcher.Fetcher | None) -> None:
        """A download of `path` starts: the whole shard is its to write, or, held to a limit by `mine`, as much as
        there is room for now (at least its first grant, which `wait_for_room` made room for)."""
        size = self.sizes[path]
        if mine is None:
            self.granted[path] = size
            return
        self.granted[path] = max(self.first_grant(path, True), min(size, self.budget - self.held()))
        self.limited[path] = mine
        mine.set_limit(self.granted[path])

    def leaving(self, path: Path, where: Path | None = None) -> Path | None:
        """Shard `path` leaves the cache (evicted, or set aside under the name `where`): if it is this run's, it
        counts as on disk until it is really gone, never in neither. Its blob, or None where it is not this run's."""
        blob = self.owned.pop(path, None)
        if blob is not None:
            self.deleted[path] = where or blob
        return blob

    def free(self, path: Path, nbytes: int) -> None:
        """`nbytes` of shard `path` were given back to the disk (holes): the downloads in flight may have them."""
        self.freed[path] = self.freed.get(path, 0) + nbytes
        self.regrant()

    def downloaded(self, path: Path, blob: Path | None) -> None:
        """The download of `path` is over (`blob`: this run put it in the cache; None: it was there, or it failed)."""
        self.granted.pop(path, None)
        self.limited.pop(path, None)
        if blob is not None:
            self.own(path, blob)

    def own(self, path: Path, blob: Path) -> None:
        """Shard `path` (its blob in the cache) is this run's: downloaded by it, or by the interrupted run it resumes."""
        self.owned[path] = blob

    def regrant(self) -> None:
        """Give the limited downloads in flight, in plan order, what the budget has room for; wake the waiters."""
        room = self.budget - self.held()
        for path in self.sizes:
            if room <= 0:
                break
            mine = self.limited.get(path)
            if mine is None:
                continue
            more = min(self.sizes[path] - self.granted[path], room)
            if more > 0:
                self.granted[path] += more
                room -= more
                mine.set_limit(self.granted[path])
        self.cond.notify_all()


def _held_files() -> set[str]:
    """The deleted files this process still maps or holds open, each as "PATH (deleted)" (how /proc names them)."""
    held: set[str] = set()
    try:
        for line in Path("/proc/self/maps").read_text().splitlines():
            fields = line.split(maxsplit=5)  # address, perms, offset, device, inode, path
            if len(fields) == 6 and fields[5].endswith(" (deleted)"):
                held.add(fields[5])
        for fd in os.listdir("/proc/self/fd"):
            try:
                held.add(os.readlink(f"/proc/self/fd/{fd}"))
            except OSError:
                continue
    except OSError:
        pass
    return held


__all__ = ["GRANT_STEP", "SLOTS", "Scratch"]
