"""A CPU kernel worker process (``python -m prequant.bnb.kernels._worker FD SIZE CHUNK``): runs the chunks `_procs`
hands it, on the shared arena it maps from FD.

Each request (`_wire.REQUEST`, on stdin) names a slot of the arena and a chunk that the parent copied into it:
a block-aligned range of one tensor. The worker runs exactly the code the thread pool runs on that range
(`_quantize4.Job` for the 4-bit codes, `_compare.chunk_sums` for the error sums), single-threaded, writes
the results into the same slot and answers with `_wire.REPLY` on its own copy of stdout. Whatever a library
prints goes to stderr. SIGINT and SIGTERM are ignored: the parent decides how a conversion ends, and a
worker ends when its stdin closes (the parent closed the pool, or died).
"""

from __future__ import annotations

import mmap
import os
import signal
import sys
import time
import traceback

import numpy as np
import torch

from . import _compare, _quantize4, _wire


class _Arena:
    """The slots of the shared arena as numpy and torch views."""

    def __init__(self, fd: int, size: int, chunk: int) -> None:
        self.map = mmap.mmap(fd, size)
        self.slot = _wire.SlotLayout(chunk)

    def array(self, slot: int, region: str, dtype: np.dtype, count: int) -> np.ndarray:
        return self.slot.array(self.map, slot, region, dtype, count)

    def tensor(self, slot: int, region: str, dtype: torch.dtype, count: int) -> torch.Tensor:
        return torch.from_numpy(self.array(slot, region, np.dtype(np.uint8), count * dtype.itemsize)).view(dtype)


def _quantize(arena: _Arena, slot: int, count: int, dtype: torch.dtype, quant_type: str, blocksize: int) -> None:
    """The 4-bit codes and absmax of one chunk, as `_quantize4.Job` computes them on the thread pool."""
    x = arena.tensor(slot, "input", dtype, count)
    packed = arena.tensor(slot, "codes", torch.uint8, (count + 1) // 2)
    absmax = arena.tensor(slot, "absmax", torch.float32, -(-count // blocksize))
    piece = max(blocksize, _wire.WORKER_PIECE // blocksize * blocksize)  # one thread: the L2-sized piece
    job = _quantize4.Job(x, quant_type, blocksize, piece, -(-count // piece), packed, absmax)
    for i in range(job.tasks):
        job.run_task(i)


def _sums(arena: _Arena, slot: int, count: int, dtype: torch.dtype, raw: np.dtype, blocksize: int,
          exponent: int) -> tuple[float, float, float]:  # fmt: skip
    """One chunk's error sums, as `_compare.error_sums` computes them on the thread pool."""
    values = arena.array(slot, "input", raw, count)
    codes = arena.array(slot, "codes", np.dtype(np.uint8), (count + 1) // 2)
    absmax = arena.array(slot, "absmax", np.dtype(np.float32), -(-count // blocksize))
    pairs = arena.tensor(slot, "pairs", torch.float64, 256)
    return _compare.chunk_sums(values, dtype, codes, absmax, pairs, blocksize, exponent)


def _read(path: bytes, at: int, device: int, inode: int, out: np.ndarray) -> None:
    """Bytes [at, at + len(out)) of the file the parent mapped, which must still be that file (same inode)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != (device, inode):
            raise OSError(f"{path.decode(errors='replace')} was replaced since the conversion mapped it")
        view, done = memoryview(out), 0
        while done < len(view):
            n = os.preadv(fd, [view[done:]], at + done)
            if n == 0:
                raise OSError(f"{path.decode(errors='replace')} ends before byte {at + len(view)}")
            done += n
    finally:
        os.close(fd)


def _serve(fd: int, size: int, chunk: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    torch.set_num_threads(1)  # one worker per core: torch must not fork threads of its own here
    arena = _Arena(fd, size, chunk)
    replies = os.dup(1)
    os.dup2(2, 1)  # a library's prints go to stderr, never into the replies
    requests = sys.stdin.buffer
    os.write(replies, _wire.READY)
    while len(data := requests.read(_wire.REQUEST.size)) == _wire.REQUEST.size:
        kind, dtype_code, aux, slot, count, blocksize, exponent, at, device, inode, length = _wire.REQUEST.unpack(data)
        path = requests.read(length) if length else b""
        dtype = _wire.DTYPES[dtype_code]
        status, sums, started = _wire.OK, (0.0, 0.0, 0.0), time.perf_counter()
        try:
            if path:  # the input is in the source file: read it into the slot (from the page cache, mostly)
                _read(path, at, device, inode, arena.array(slot, "input", np.dtype(np.uint8), count * dtype.itemsize))
            if kind == _wire.QUANTIZE:
                _quantize(arena, slot, count, dtype, _wire.QUANT_TYPES[aux], blocksize)
            else:
                sums = _sums(arena, slot, count, dtype, _wire.RAW_DTYPES[aux], blocksize, exponent)
        except _quantize4.NonFinite:
            status = _wire.NON_FINITE
        except Exception:  # noqa: BLE001 - reported to the parent, which redoes the tensor on its threads
            traceback.print_exc()
            status = _wire.FAILED
        os.write(replies, _wire.REPLY.pack(slot, status, *sums, time.perf_counter() - started))


if __name__ == "__main__":
    _serve(*map(int, sys.argv[1:4]))
