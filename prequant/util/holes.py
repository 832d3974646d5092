"""Give a file's disk blocks back while keeping its size: `fallocate(FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE)`.

A Hub source shard that a conversion with --delete-source-shards has read part of is freed piece by piece, each
tensor's bytes as its outputs are written, so that the next shard's download can use the space (`source.hub_stream`)
rather than wait for the whole shard to be converted. Linux only, on filesystems that support it (ext4, XFS, btrfs,
tmpfs); elsewhere `punch` frees nothing and says so, and the caller frees whole files.

Standard library only (ctypes), like the rest of util/.
"""

from __future__ import annotations

import ctypes
import errno
import os
import sys

_PUNCH_HOLE = 0x02  # FALLOC_FL_PUNCH_HOLE, linux/falloc.h
_KEEP_SIZE = 0x01  # FALLOC_FL_KEEP_SIZE: required with PUNCH_HOLE
# Errors that mean "this filesystem (or kernel) cannot punch holes", not "this call was wrong".
_UNSUPPORTED = frozenset({errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL, errno.ENOTTY})


class Unsupported(OSError):
    """The file's filesystem cannot punch holes: free the whole file instead."""


def _fallocate():
    """libc's fallocate(int, int, off_t, off_t), or None where there is none (not Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        call = libc.fallocate
    except (OSError, AttributeError):
        return None
    call.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    call.restype = ctypes.c_int
    return call


_CALL = _fallocate()


def block_size(fd: int) -> int:
    """The granularity that frees blocks on this file's filesystem: its fundamental block size (statvfs'
    f_frsize, not st_blksize, which is the preferred I/O size and may be far larger), at least a page."""
    return max(os.fstatvfs(fd).f_frsize, os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096)


def inner(start: int, end: int, block: int) -> tuple[int, int]:
    """The whole blocks inside [start, end): (first byte, end byte), empty (start == end) if none. Only whole
    blocks are freed; a block shared with bytes still needed (the neighbouring tensor's) stays."""
    first = -(-start // block) * block
    last = end // block * block
    return (first, last) if last > first else (first, first)


def punch(fd: int, start: int, end: int) -> int:
    """Free the whole blocks of [start, end) of the open file `fd` (reads there then return zeros); return the
    bytes freed. Raises `Unsupported` where the filesystem or platform cannot, OSError for any other failure."""
    block = block_size(fd)
    first, last = inner(start, end, block)
    if last == first:
        return 0
    if _CALL is None:
        raise Unsupported(errno.ENOSYS, "fallocate is not available on this platform")
    if _CALL(fd, _PUNCH_HOLE | _KEEP_SIZE, first, last - first) != 0:
        err = ctypes.get_errno()
        if err in _UNSUPPORTED:
            raise Unsupported(err, os.strerror(err))
        raise OSError(err, os.strerror(err))
    return last - first


__all__ = ["Unsupported", "block_size", "inner", "punch"]
