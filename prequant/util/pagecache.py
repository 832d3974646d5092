"""Asking Linux to read a file range ahead (`posix_fadvise(WILLNEED)`) in pieces it does not cut short."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

MIN_ADVICE = 128 * 1024  # the kernel's default readahead: what one WILLNEED call reads at the very least
MAX_ADVICE = 64 * 1024 * 1024


def advice_chunk(fd: int) -> int:
    """The most bytes one `posix_fadvise(WILLNEED)` call makes Linux read on this file's disk.

    Linux silently caps each call at the device's readahead size or largest I/O, whichever is larger
    (`force_page_cache_ra`): a 64 MiB request on a disk with 8 MiB readahead reads 8 MiB and drops the rest.
    Advice must therefore come in pieces of at most this size. Unknown device (overlay, NFS): the default."""
    try:
        queue = whole_disk(os.fstat(fd).st_dev) / "queue"
        kb = max(int((queue / name).read_text()) for name in ("read_ahead_kb", "max_sectors_kb"))
        return min(MAX_ADVICE, max(MIN_ADVICE, kb * 1024))
    except (OSError, ValueError):
        return MIN_ADVICE


def whole_disk(dev: int) -> Path:
    """The sysfs folder of the disk that holds the device `dev` (a file's `st_dev`): the device's own, or for a
    partition its disk's, which holds the queue settings and names the disk in /proc/diskstats. It need not exist
    (an overlay, tmpfs or NFS has no block device): what is read from it then raises OSError."""
    base = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    return base if (base / "queue").is_dir() else base.resolve().parent


def pieces(offset: int, length: int, chunk: int) -> Iterator[tuple[int, int]]:
    """(start, bytes) covering [offset, offset+length) in order, none larger than `chunk`: the pieces one
    `posix_fadvise(WILLNEED)` call each, so that Linux reads all of them (see `advice_chunk`)."""
    for start in range(offset, offset + length, chunk):
        yield start, min(chunk, offset + length - start)


def will_need(fd: int, offset: int, length: int) -> None:
    """Ask for [offset, offset+length) of the file to be read into the page cache, asynchronously, in pieces Linux
    reads whole. Advisory: errors are ignored (the reads that follow report any real problem)."""
    try:
        for start, piece in pieces(offset, length, advice_chunk(fd)):
            os.posix_fadvise(fd, start, piece, os.POSIX_FADV_WILLNEED)
    except (OSError, AttributeError):
        pass
