"""Independent pieces of work run on a pool of Python threads, each piece single-threaded.

Why not torch's intra-op parallelism: it splits each *operation* over its threads, so a kernel of a dozen
small passes pays a fork and a join per pass, its threads spin at every barrier (ruinous on a loaded
machine), and operations torch runs serially (1-D ``index_select``, the kernel's table lookup, is a plain
loop) cap the speed-up whatever the thread count. Here a tensor is cut into block-aligned pieces and each
thread takes a whole piece through every pass while it is in its core's cache. The pieces use numpy
(always single-threaded) and torch operations that never fork (1-D ``index_select``; any operation where
torch has one thread), and both release the GIL while they run, so the threads overlap. Cutting a torch
operation below torch's grain (32768 elements) to keep it from forking does not pay: such calls are much
shorter than a piece, and each hands the GIL over (`_quantize4.Job.torch_inline`).

The calling thread works too, so one thread means no pool at all; a call made from a pool thread (nested
use) runs serially. Whatever happens (an error in a piece, KeyboardInterrupt in the caller), `run` returns
only once no thread touches the caller's tensors any more: a thread left running could read a memory map
the caller is about to close.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

# Threads to use; None follows torch.get_num_threads() (one per core unless the user set it), so that
# torch.set_num_threads and OMP_NUM_THREADS bound this pool as they bound torch's own.
THREADS: int | None = None

_local = threading.local()
_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_pool_size = 0


def threads() -> int:
    """Threads a call to `run` uses now (the caller included)."""
    return max(1, THREADS if THREADS is not None else torch.get_num_threads())


def task_elements(base: int, cap: int) -> int:
    """Elements per piece of work for the thread count now: `base` on one thread, 4x as many per doubling of
    the threads, at most `cap` (powers of two, so the result is a multiple of every blocksize <= base).

    Why pieces grow with the threads: each numpy call holds the GIL for its Python part and must take it
    back when its loop ends, and every hand-over wakes a sleeping thread, so a call's loop must outlast
    the hand-overs of all the other threads. On one thread the small pieces are as fast and stay in the core's
    cache; the cap bounds each thread's buffers (about 18 bytes per element in the 4-bit kernel).
    """
    return min(cap, base << 2 * (threads() - 1).bit_length())


def run(count: int, work: Callable[[int], None]) -> None:
    """Call ``work(i)`` for every i in range(count), on up to `threads()` threads; re-raise the first error.

    Pieces are handed out in order, one at a time, to whichever thread is free (so uneven pieces and a
    busy core balance out); a failure stops the hand-out and the pieces already started finish.
    """
    helpers = min(threads(), count) - 1
    if helpers <= 0 or getattr(_local, "in_pool", False):
        for i in range(count):
            work(i)
        return
    job = _Job(count, work)
    pool = _executor(helpers)
    futures = [pool.submit(job.drain, True) for _ in range(helpers)]
    try:
        job.drain(False)
    except BaseException as e:  # noqa: BLE001 - recorded like a worker's error, re-raised below
        job.fail(e)
    finally:
        job.stop.set()
        # Helpers still queued behind another caller's job never start; the others finish their piece.
        for f in futures:
            f.cancel()
        _wait_uninterrupted(futures)
    if job.error is not None:
        raise job.error


class _Job:
    """The pieces of one `run` call: a shared cursor, a stop flag and the first error."""

    def __init__(self, count: int, work: Callable[[int], None]) -> None:
        self.count, self.work = count, work
        self.next = 0
        self.cursor = threading.Lock()
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def drain(self, in_pool: bool) -> None:
        _local.in_pool = in_pool or getattr(_local, "in_pool", False)
        while not self.stop.is_set():
            with self.cursor:
                i, self.next = self.next, self.next + 1
            if i >= self.count:
                return
            if not in_pool:
                self.work(i)  # the caller's own errors propagate to `run`
                continue
            try:
                self.work(i)
            except BaseException as e:  # noqa: BLE001 - handed to the calling thread
                self.fail(e)

    def fail(self, error: BaseException) -> None:
        with self.cursor:
            if self.error is None:
                self.error = error
        self.stop.set()


def _executor(helpers: int) -> ThreadPoolExecutor:
    """The process-wide pool, grown (never shrunk: idle threads cost nothing) to at least `helpers`."""
    global _pool, _pool_size
    with _lock:
        if _pool is None or _pool_size < helpers:
            old, _pool = _pool, ThreadPoolExecutor(max_workers=helpers, thread_name_prefix="prequant-kernel")
            _pool_size = helpers
            if old is not None:
                old.shutdown(wait=False)
        return _pool


def _wait_uninterrupted(futures: list[Future]) -> None:
    """Wait for every started future, even through KeyboardInterrupt (re-raised once all are done)."""
    interrupted: BaseException | None = None
    for f in futures:
        while True:
            try:
                if not f.cancelled():
                    f.exception()  # waits; the job records the error itself
                break
            except BaseException as e:  # noqa: BLE001 - a second Ctrl-C while waiting: keep waiting
                interrupted = interrupted or e
    if interrupted is not None:
        raise interrupted
