"""Keep the disk busy: read the source into the page cache ahead of the pipeline, in the background.

A conversion is bound by the disk. Two things would leave it idle: the few seconds a cold process
spends importing torch, CUDA and transformers, and the gaps between the pipeline's own reads. So the
CLI starts this before any heavy import (standard library only), and it keeps asking the kernel
(`posix_fadvise(WILLNEED)`, asynchronous) for the next bytes of the weight files in file order, the
order the pipeline reads them, staying at most a window ahead of what the pipeline has consumed. The
window bounds page-cache use, which is reclaimable anyway, never anonymous memory. Purely advisory:
any problem here is ignored; the real checks happen in source.py and reader.py.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

_STEP = 64 * 1024 * 1024
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


def willneed(fd: int, offset: int, length: int, chunk: int | None = None) -> None:
    """Ask the kernel to read [offset, offset+length) into the page cache, asynchronously, in pieces it honours."""
    chunk = chunk or advice_chunk(fd)
    for start in range(offset, offset + length, chunk):
        os.posix_fadvise(fd, start, min(chunk, offset + length - start), os.POSIX_FADV_WILLNEED)


def default_window() -> int:
    """A quarter of the memory available. Page cache, not process memory: the kernel reclaims it under
    pressure. It is large on purpose: a cold process spends seconds importing torch, transformers and
    bitsandbytes, and whatever the disk reads meanwhile is what the pipeline then gets at memory speed."""
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
        return max(_STEP, avail // 4)
    except (OSError, StopIteration, ValueError):
        return 2 * 10**9


class Readahead:
    """A background thread that keeps up to `window` bytes of the source read ahead of `consumed`."""

    def __init__(self, files: list[Path], window: int | None = None) -> None:
        self.files = [Path(f) for f in files]
        self.window = window or default_window()
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
        global _current
        with self._cond:
            self._stopped = True
            self._cond.notify()
        if _current is self:
            _current = None  # the next conversion in this process starts a fresh one

    def _run(self) -> None:
        position = 0
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
                            willneed(fd, offset, n, chunk)
                        position += n
                finally:
                    os.close(fd)
        except Exception:  # noqa: BLE001 - advisory only
            pass


_current: Readahead | None = None


def start(files: list[Path]) -> Readahead | None:
    """Start (or keep, if already started on the same files) the process' readahead."""
    global _current
    if not hasattr(os, "posix_fadvise"):
        return None
    files = [Path(f) for f in files]
    if _current is None or _current.files != files:
        if _current is not None:
            _current.stop()
        _current = Readahead(files)
    return _current


def start_for_source(source: str) -> None:
    """From the CLI, before torch is imported: the weight files of a local checkpoint directory. (Not for a
    dry run, which reads headers only, nor a resume, whose finished part convert() reports before it starts.)"""
    from . import source as sources  # standard library only, like this module

    try:
        path = Path(source)
        if path.is_dir():
            start(list(sources.local(source, path).weight_files))
    except Exception:  # noqa: BLE001 - advisory only; convert() reports any problem properly
        pass
