"""What the CPU kernel's worker processes and their pool (`_procs`) say to each other, and the arena they share.

A request is a fixed-size header (`REQUEST`), followed by a file's path when the chunk is to be read from that
file; a reply is `REPLY`. Each slot of the shared arena (`SlotLayout`) holds one chunk's input, codes,
absmax and the statistics' table of code pairs.
"""

from __future__ import annotations

import mmap
import os
import struct
from typing import NamedTuple

import numpy as np
import torch

WORKER_PIECE = 1 << 16  # elements per piece inside a worker: its buffers stay in the core's L2 cache

# The wire: requests (kind, dtype, aux, slot, count, blocksize, exponent, then where the input is: byte offset,
# device, inode and path length of a file, followed by the path; length 0: in the slot) and replies (slot,
# status, sums, seconds the worker computed).
REQUEST = struct.Struct("<BBBxiqiiqQQH")
REPLY = struct.Struct("<iidddd")
READY = b"R"
QUANTIZE, SUMS = 1, 2
OK, NON_FINITE, FAILED = 0, 1, 2
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
QUANT_TYPES = ("nf4", "fp4")
RAW_DTYPES = (np.dtype(np.uint16), np.dtype(np.float16), np.dtype(np.float32))  # a source range, as `_flat` reads it


class SlotLayout:
    """Where each region of a slot for `chunk` elements starts: the input (float32 at most), codes, absmax, a table."""

    def __init__(self, chunk: int) -> None:
        sizes = {"input": chunk * 4, "codes": chunk // 2, "absmax": chunk // 64 * 4, "pairs": 256 * 8}
        self.offsets, at = {}, 0
        for region, size in sizes.items():
            self.offsets[region], at = at, at + size
        self.size = -(-at // mmap.PAGESIZE) * mmap.PAGESIZE

    def array(self, arena: mmap.mmap, slot: int, region: str, dtype: np.dtype, count: int) -> np.ndarray:
        """A region of a slot of `arena` as numpy (the pool's mapping or a worker's: the same bytes)."""
        return np.frombuffer(arena, dtype=dtype, count=count, offset=slot * self.size + self.offsets[region])


class Origin(NamedTuple):
    """Where a tensor's bytes lie in a file this process has mapped: the workers read them there (in parallel,
    from the page cache) rather than this thread copying them into the arena."""

    path: bytes
    offset: int  # of the tensor's first byte in the file
    device: int
    inode: int


def file_origin(x: torch.Tensor) -> Origin | None:
    """The file and offset of a contiguous tensor's bytes when they are a mapped file's (a source view), else None.

    Read from /proc/self/maps, so it covers every reader (safetensors views, `.bin` shards loaded with mmap).
    A private mapping is the file's bytes as long as nobody writes it, and prequant never writes a source view.
    A deleted or replaced file is refused here, or by the worker (whose read checks the inode)."""
    if not x.is_contiguous() or x.numel() == 0:
        return None
    start, end = x.data_ptr(), x.data_ptr() + x.numel() * x.element_size()
    try:
        with open("/proc/self/maps", "rb") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                low, _, high = fields[0].partition(b"-")
                if len(fields) == 6 and int(low, 16) <= start and end <= int(high, 16):
                    path = fields[5].rstrip(b"\n")
                    if not path.startswith(b"/") or path.endswith(b" (deleted)"):
                        return None
                    major, _, minor = fields[3].partition(b":")
                    mapped = (os.makedev(int(major, 16), int(minor, 16)), int(fields[4]))
                    st = os.stat(path)
                    if (st.st_dev, st.st_ino) != mapped:  # replaced since (or a file system whose maps differ)
                        return None
                    return Origin(path, int(fields[2], 16) + start - int(low, 16), *mapped)
    except (OSError, ValueError):
        pass
    return None


def request(kind: int, dtype: torch.dtype, aux: int, slot: int, count: int, blocksize: int, exponent: int = 0,
            origin: Origin | None = None, first_byte: int = 0) -> bytes:  # fmt: skip
    """One request: a chunk of `count` elements in `slot`, or, with `origin`, at `first_byte` of that tensor's file."""
    if origin is None:
        return REQUEST.pack(kind, DTYPES.index(dtype), aux, slot, count, blocksize, exponent, 0, 0, 0, 0)
    head = REQUEST.pack(kind, DTYPES.index(dtype), aux, slot, count, blocksize, exponent, origin.offset + first_byte,
                        origin.device, origin.inode, len(origin.path))  # fmt: skip
    return head + origin.path
