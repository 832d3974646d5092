"""Keep the disk busy: read the source into the page cache ahead of the pipeline, in the background.

A conversion is bound by the disk. Two things would leave it idle: the few seconds a cold process
spends importing torch, CUDA and transformers, and the gaps between the pipeline's own reads. So the
CLI starts this before any heavy import (standard library only), and it keeps asking the kernel
(`posix_fadvise(WILLNEED)`, asynchronous) for the next bytes of the weight files in file order, the
order the pipeline reads them, staying at most a window ahead of what the pipeline has consumed. The
window bounds page-cache use, which is reclaimable anyway, never anonymous memory. Purely advisory:
any problem here is ignored; the real checks happen in `source` and `checkpoint`.

It also bounds how much it has asked of the disk and not yet received (`depth`). Unbounded, the advice
fills the device's whole request queue (256 requests of up to 4 MiB on the GPU machine's virtio disk, about
a gigabyte), and any other read, such as a library page the imports fault in, waits behind all of it:
on the GPU machine the start-up (imports, bitsandbytes, CUDA) took 10 s instead of 4 s beside it. The
depth is shallow while the processes start up (32 MiB still reads a cold 16 GB as fast as no bound does,
8.5 against 8.35 s), then deeper once the pipeline runs (128 MiB): its shard writes share the queue, and
with 32 MiB they starved the reads (the 16 GB pipeline took 7.2 s instead of 4.9 s).
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Iterator
from pathlib import Path

_STEP = 64 * 1024 * 1024
# Bytes asked of the disk and not yet read: enough to keep it streaming, little for other reads to wait behind.
START_DEPTH = 32 * 1024 * 1024  # while torch, bitsandbytes, CUDA and transformers load
PIPELINE_DEPTH = 128 * 1024 * 1024  # once the pipeline reads and writes too
_MIN_ADVICE = 128 * 1024  # the kernel's default readahead: what one WILLNEED call reads at the very least


def advice_chunk(fd: int) -> int:
    """The most bytes one `posix_fadvise(WILLNEED)` call makes Linux read on this file's disk.

    Linux silently caps each call at the device's readahead size or largest I/O, whichever is larger
    (`force_page_cache_ra`): a 64 MiB request on a disk with 8 MiB readahead reads 8 MiB and drops the rest.
    Advice must therefore come in pieces of at most this size. Unknown device (overlay, NFS): the default."""
    try:
        dev = os.fstat(fd).st_dev
        base = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
        queue = base / "queue" if (base / "queue").is_dir() else base.resolve().parent / "queue"  # a partition
        kb = max(int((queue / name).read_text()) for name in ("read_ahead_kb", "max_sectors_kb"))
        return min(_STEP, max(_MIN_ADVICE, kb * 1024))
    except (OSError, ValueError):
        return _MIN_ADVICE


def pieces(offset: int, length: int, chunk: int) -> Iterator[tuple[int, int]]:
    """(start, bytes) covering [offset, offset+length) in order, none larger than `chunk`: the pieces one
    `posix_fadvise(WILLNEED)` call each, so that Linux reads all of them (see `advice_chunk`)."""
    for start in range(offset, offset + length, chunk):
        yield start, min(chunk, offset + length - start)


def default_window() -> int:
    """A quarter of the memory available (to this container, when its cgroup has a limit). Page cache, not
    process memory: the kernel reclaims it under pressure. It is large on purpose: a cold process spends
    seconds importing torch, transformers and bitsandbytes, and whatever the disk reads meanwhile is what
    the pipeline then gets at memory speed. Past the container's limit, it would evict the pages just read."""
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return 2 * 10**9
    room = _cgroup_room()
    return max(_STEP, min(avail, room if room is not None else avail) // 4)


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
    """A background thread that keeps up to `window` bytes of the source read ahead of `consumed`."""

    def __init__(self, files: list[Path], window: int | None = None, depth: int = PIPELINE_DEPTH) -> None:
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

    def set_depth(self, depth: int) -> None:
        """From the next request on, keep at most `depth` bytes asked of the disk and not yet read."""
        self.depth = depth

    def stop(self) -> None:
        global _current
        with self._cond:
            self._stopped = True
            self._cond.notify()
        if _current is self:
            _current = None  # the next conversion in this process starts a fresh one

    def _run(self) -> None:
        position = 0
        asked: deque[tuple[int, int]] = deque()  # (end offset, bytes) of advice not yet known to be read
        try:
            for file in self.files:
                fd = os.open(file, os.O_RDONLY)
                try:
                    size = os.fstat(fd).st_size
                    chunk = advice_chunk(fd)
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
                                _wait_read(fd, asked, self.depth - piece)  # depth read afresh: set_depth
                                os.posix_fadvise(fd, start, piece, os.POSIX_FADV_WILLNEED)
                                asked.append((start + piece, piece))
                        position += n
                    _wait_read(fd, asked, 0)  # before this file's descriptor closes
                finally:
                    os.close(fd)
        except Exception:  # noqa: BLE001 - advisory only
            pass


def _wait_read(fd: int, asked: deque[tuple[int, int]], limit: int) -> None:
    """Wait, oldest first, until at most `limit` bytes of advice are still being read. Reading a piece's last
    byte waits for that page's I/O, which the disk completes about when the rest of the piece."""
    while asked and sum(n for _, n in asked) > limit:
        end, _ = asked.popleft()
        os.pread(fd, 1, end - 1)


_current: Readahead | None = None


def start(files: list[Path], depth: int = PIPELINE_DEPTH) -> Readahead | None:
    """Start (or keep, if already started on the same files) the process' readahead, at this depth."""
    global _current
    if not hasattr(os, "posix_fadvise"):
        return None
    files = [Path(f) for f in files]
    if _current is None or _current.files != files:
        if _current is not None:
            _current.stop()
        _current = Readahead(files, depth=depth)
    _current.set_depth(depth)
    return _current


def start_for_source(source: str) -> None:
    """From the CLI, before torch is imported: the weight files of a local checkpoint directory. (Not for a
    dry run, which reads headers only, nor a resume, whose finished part convert() reports before it starts.)"""
    from ..source.local import local  # standard library only, like this module

    try:
        path = Path(source)
        if path.is_dir():
            start(list(local(source, path).weight_files), depth=START_DEPTH)
    except Exception:  # noqa: BLE001 - advisory only; convert() reports any problem properly
        pass
