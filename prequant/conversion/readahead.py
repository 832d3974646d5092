"""Keep the disk busy: read a local source into the page cache ahead of the pipeline, in the background.

A conversion is bound by the disk, and the gaps between the pipeline's own reads would leave it idle. So a thread
keeps asking the kernel (`posix_fadvise(WILLNEED)`, asynchronous) for the next bytes of the weight files in file
order, the order the pipeline reads them, staying at most a window ahead of what the pipeline has consumed. The
window bounds page-cache use, which is reclaimable anyway, never process memory; the depth bounds what is asked of
the disk and not yet read, so that other reads (a shard's writes, a library page faulted in) never wait behind a
full device queue. Purely advisory: any problem here is ignored; the real checks happen in `source` and
`checkpoint`.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from pathlib import Path

from ..util import trace
from ..util.pagecache import advice_chunk, pieces

_STEP = 64 * 1024 * 1024  # the window is checked once per step: few wake-ups, a fine enough bound
DEPTH = 128 * 1024 * 1024  # asked and not yet read: keeps the disk streaming beside the shard writes' requests
START_DEPTH = 16 * 1024 * 1024  # while the libraries load: little for their page faults to wait behind


def default_window() -> int:
    """A quarter of the memory available (to this container, when its cgroup has a limit): page cache that the
    pipeline then reads at memory speed, while past the container's limit it would evict the pages just read."""
    avail = _available()
    if avail is None:
        return 2 * 10**9
    room = _cgroup_room()
    return max(_STEP, min(avail, room if room is not None else avail) // 4)


def _available(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """MemAvailable of /proc/meminfo in bytes, or None where it cannot be read (not Linux, no /proc)."""
    try:
        with open(meminfo) as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return None


def _cgroup_room(proc: Path = Path("/proc/self/cgroup"), root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Bytes this process' cgroup (v2) may still use before its memory limit, or None without a limit."""
    try:
        lines = proc.read_text().splitlines()
        rel = next(line[3:] for line in lines if line.startswith("0::"))
        group = root / rel.lstrip("/")
        limit = (group / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return max(0, int(limit) - int((group / "memory.current").read_text()))
    except (OSError, StopIteration, ValueError):
        return None


class Readahead:
    """A background thread that keeps up to `window` bytes of the files read ahead of `consumed`, with at most
    `depth` bytes asked of the disk and not yet read."""

    def __init__(self, files: list[Path], window: int | None = None, depth: int = DEPTH) -> None:
        self.files = [Path(f) for f in files]
        self.window = window or default_window()
        self.depth = depth
        self._consumed = 0
        self._cond = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="prequant-readahead", daemon=True)
        self._thread.start()

    def consumed(self, nbytes: int) -> None:
        """The pipeline has finished with `nbytes` more of the source, in file order."""
        with self._cond:
            self._consumed += nbytes
            self._cond.notify()

    def stop(self) -> None:
        """Ask nothing more (what was asked is read all the same)."""
        with self._cond:
            self._stopped = True
            self._cond.notify()

    def _run(self) -> None:
        position = 0
        asked: deque[tuple[int, int]] = deque()  # (end offset, bytes) of advice not yet known to be read
        try:
            for file in self.files:
                fd = os.open(file, os.O_RDONLY)
                try:
                    size = os.fstat(fd).st_size
                    chunk = min(advice_chunk(fd), self.depth)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
                    for offset in range(0, size, _STEP):
                        n = min(_STEP, size - offset)
                        with self._cond:
                            self._cond.wait_for(lambda: self._stopped or position - self._consumed < self.window)
                            if self._stopped:
                                return
                            behind = position + n <= self._consumed  # done already (e.g. before a --resume)
                        if not behind:
                            for start, piece in pieces(offset, n, chunk):
                                _wait_read(fd, asked, self.depth - piece)
                                os.posix_fadvise(fd, start, piece, os.POSIX_FADV_WILLNEED)
                                asked.append((start + piece, piece))
                        position += n
                    _wait_read(fd, asked, 0)  # before this file's descriptor closes
                finally:
                    os.close(fd)
            trace.mark("read-ahead-done")
        except Exception:  # noqa: BLE001 - advisory only
            pass


def _wait_read(fd: int, asked: deque[tuple[int, int]], limit: int) -> None:
    """Wait, oldest first, until at most `limit` bytes of advice are still being read. Reading a piece's last
    byte waits for that page's I/O, which the disk completes about when the rest of the piece."""
    while asked and sum(n for _, n in asked) > limit:
        end, _ = asked.popleft()
        os.pread(fd, 1, end - 1)


def prefetch(source: str | None, first: list[Path] | None = None) -> None:
    """From the CLI, before torch's import: begin reading `first` (a merge's adapter weights), then a local
    SOURCE's weight files, into the page cache (up to the default window), so that the disk works while the
    libraries load instead of after. The job's own read-ahead takes over once its pipeline runs; pages already
    read cost it nothing. Standard library only; advisory: anything unexpected is left for the job to report."""
    from ..source.spec import local

    files = list(first or [])
    try:
        path = Path(source) if source else None
        if path is not None and path.is_dir():
            files += local(source, path).weight_files
    except Exception:  # noqa: BLE001, S110 - advisory only
        pass
    if files and hasattr(os, "posix_fadvise"):
        Readahead(files, depth=START_DEPTH)  # nothing consumed: up to the window


def start(files: list[Path], window: int | None = None) -> Readahead | None:
    """Read `files` ahead of the pipeline, at most `window` bytes ahead (default: `default_window`); None where
    the system gives no read-ahead advice. The caller reports what it consumed and stops it."""
    if not hasattr(os, "posix_fadvise"):
        return None
    return Readahead(files, window=window)
