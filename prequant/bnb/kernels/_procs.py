"""The CPU kernel's chunks on worker processes, past the one GIL that caps the thread pool on many cores.

`_parallel`'s threads overlap only while numpy's loops run: every call takes the GIL back, and on 16 cores
the hand-overs cost more than the pieces. So large tensors can go to a pool of worker processes (`_worker`),
each running the thread pool's own code on one chunk at a time, single-threaded.

How a tensor goes through: the kernel cuts it into whole rounds of chunks (as many per worker) of at most
`CHUNK` elements; the statistics' chunks are exactly `_compare`'s tasks, so the sums are the same numbers
added in the same order. Each chunk gets a slot of a shared arena (an anonymous memfd every worker maps) and a
fixed-size request on its worker's stdin (`_wire`); the results are copied out of the slot when the reply
comes. Each worker has two slots, so it finds its next chunk waiting when it finishes one. A tensor that is a
mapped file's bytes (a source view: `_wire.file_origin`) is read by the workers themselves from that file, in
parallel; any other (a cast, a transposed Conv1D weight) is copied into the slots by this thread. Bytes are
the thread pool's: the same functions compute them from the same values.

The pool starts on the first large tensor, without waiting: until its workers have imported torch (a second
or two, in parallel), tensors go to the threads. A worker that fails or dies closes the pool and the tensor is
redone on the threads; an interrupt kills the workers (they only ever touch the arena, never a caller's tensor).

Off unless asked (PREQUANT_CPU_PROCESSES=N, or =auto: one per thread of `_parallel.threads()`, as many as an
eighth of the available memory holds at `WORKER_BYTES` each, none below `AUTO_MIN`). Measured on the GPU
machine's 16 cores, 2026-12-01: the kernel alone (`scripts/bench/cpu_kernel.py --shapes 14336x4096 --threads 16`)
made 2.13-2.32 GB/s on 16 workers against 1.65-1.80 on the threads, and a 16 GB Llama-shaped conversion run
in-process with its source in the page cache took 17.2 s against 23.4 s; but the whole `prequant convert`
process from a cold page cache took 26.2 s against 26.8 s (`scripts/bench/convert.py --size-gb 16 --shape llama
--device cpu --warm-libraries`, same lease): its pipeline gained 2.5 s, the workers' start-up and the last
shard's hash took most of it back. Against that, 16 workers hold 4.56 GB (torch's CUDA build) of memory.
The workers computed 62% of the time they were given: each tensor still goes kernel, double quantization,
statistics one after another, and tensors below `MIN_ELEMENTS` stay on the threads. So conversions now hand whole
tensors to workers of their own instead (`bnb.tensor_pool`, on by default on 4 cores or more); this pool serves
`kernels.cpu.quantize_4bit` and the statistics when they are called directly, with PREQUANT_CPU_PROCESSES set.
"""

from __future__ import annotations

import atexit
import logging
import mmap
import os
import select
import selectors
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from ...util import memory, trace
from .. import tensor_spawn
from . import _parallel, _quantize4
from ._wire import FAILED, NON_FINITE, READY, REPLY, SlotLayout

log = logging.getLogger(__name__)

ENV = "PREQUANT_CPU_PROCESSES"
PROCESSES: int | None = None  # workers; None: as PREQUANT_CPU_PROCESSES says (tests set it)
AUTO_MIN = 4  # fewer workers than this: the GIL costs the threads little, and the workers' imports would not pay
WORKER_BYTES = tensor_spawn.WORKER_BYTES  # a worker's own memory, mostly its torch import
MIN_ELEMENTS = 1 << 22  # smaller tensors stay on the threads (a few milliseconds there)
# Elements per chunk, at most: 2-4 MiB of input, a few milliseconds of one core. The kernel cuts a tensor
# into whole rounds of chunks (as many per worker); the statistics' chunks are `_compare`'s tasks.
CHUNK = 1 << 20
SLOTS_PER_WORKER = 2
MAX_FAILURES = 3  # pools whose workers failed, at most: then this process keeps to the threads

_PACKAGE_ROOT = str(Path(__file__).resolve().parents[3])  # the directory holding this prequant


class Unavailable(Exception):
    """The pool cannot take this tensor (a worker failed or died): the caller uses the threads."""


def workers() -> int:
    """Worker processes large tensors use now (0: the threads only): PROCESSES, else PREQUANT_CPU_PROCESSES (a
    number, or "auto"); unset, none (see the module's notes for why)."""
    if PROCESSES is not None:
        return max(0, PROCESSES)
    text = os.environ.get(ENV, "").strip().lower()
    if text == "auto":
        # One per thread, as far as an eighth of the memory available pays for their torch imports.
        count = min(_parallel.threads(), _memory_available() // 8 // WORKER_BYTES)
        return count if count >= AUTO_MIN else 0
    try:
        return max(0, int(text or 0))
    except ValueError:
        log.warning("%s=%r is neither a number of processes nor auto; using the threads", ENV, text)
        return 0


def _memory_available() -> int:
    """MemAvailable in bytes (0 where it cannot be read: then no workers)."""
    return memory.available() or 0


def pool_for(elements: int, *, wait: bool = False) -> Pool | None:
    """The ready pool for a tensor of `elements`, or None (use the threads). Starts the pool when a large
    tensor first asks, and returns None until its workers are ready, unless `wait`."""
    count = workers()
    if count == 0 or elements < MIN_ELEMENTS:
        return None
    global _pool, _failures
    with _lock:
        if _pool is not None and _pool.pid != os.getpid():  # a forked child: the workers are its parent's
            _pool = None
        settings = (count, CHUNK, SLOTS_PER_WORKER)
        if _pool is not None and ((_pool.size, _pool.chunk, _pool.slots) != settings or _pool.broken):
            _failures += _pool.failed
            _pool.close()
            _pool = None
        if _pool is None:
            if _failures >= MAX_FAILURES or sys.platform != "linux":
                return None
            try:
                _pool = Pool(count)
            except OSError as error:  # no memfd, no python executable...: the threads do it
                log.debug("CPU kernel on threads: no worker processes (%s)", error)
                _failures = MAX_FAILURES
                return None
        pool = _pool
    return pool if pool.ready(wait) else None


def close(kill: bool = False) -> None:
    """End the workers (tests; at exit, killed: they hold nothing worth waiting for, and waiting for each to
    see its stdin close took 0.7 s of a conversion's exit with 16 of them)."""
    global _pool
    with _lock:
        pool, _pool = _pool, None
    if pool is not None and pool.pid == os.getpid():
        pool.close(kill)


class Pool:
    """`size` worker processes and the arena they share, for chunks of up to `chunk` elements; one caller at a
    time (`busy`)."""

    def __init__(self, size: int) -> None:
        self.size, self.chunk, self.slots, self.pid = size, CHUNK, SLOTS_PER_WORKER, os.getpid()
        self.layout = SlotLayout(self.chunk)
        self.broken = self.failed = False  # closed; closed because a worker failed
        self.chunks = 0  # chunks done by the workers, all tensors together
        self.busy, self._ready_lock = threading.Lock(), threading.Lock()
        self._procs: list[subprocess.Popen[bytes]] = []
        self._selector = selectors.DefaultSelector()
        self._fd = os.memfd_create("prequant-kernel")
        try:
            os.ftruncate(self._fd, self.layout.size * size * self.slots)
            self._map = mmap.mmap(self._fd, self.layout.size * size * self.slots)
            paths = (_PACKAGE_ROOT, os.environ.get("PYTHONPATH"))  # the workers import this same prequant
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p), "OMP_NUM_THREADS": "1"}
            args = (self._fd, len(self._map), self.chunk)
            cmd = [sys.executable, "-m", "prequant.bnb.kernels._worker", *map(str, args)]
            for i in range(size):
                proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, pass_fds=(self._fd,),
                                        env=env)  # fmt: skip
                self._procs.append(proc)
                self._selector.register(proc.stdout, selectors.EVENT_READ, i)  # type: ignore[arg-type]
        except BaseException:
            self.close()
            raise
        self._waiting = [p.stdout.fileno() for p in self._procs]  # type: ignore[union-attr]

    def ready(self, wait: bool) -> bool:
        """Whether every worker has said it is ready (reading what they said so far; waiting if `wait`)."""
        with self._ready_lock:  # two threads must not both read one worker's byte (the second would block)
            return self._read_ready(wait)

    def _read_ready(self, wait: bool) -> bool:
        while self._waiting and not self.broken:
            said, _, _ = select.select(self._waiting, [], [], None if wait else 0)
            for fd in said:
                if os.read(fd, 1) != READY:  # a worker that died while starting
                    self.broken = self.failed = True
                self._waiting.remove(fd)
            if not wait:
                break
            if not self._waiting:
                trace.mark("cpu-workers-ready")
        return not self._waiting and not self.broken

    def run(self, count: int, fill: Callable[[int, int], bytes], collect: Callable[[int, int, tuple], None]) -> None:
        """For each chunk i < count: `fill(i, slot)` copies its input into `slot` and returns its request, and
        `collect(i, slot, (err2, ref2, max_err))` takes its results out once its worker replied. Raises
        `_quantize4.NonFinite` if a chunk held NaN or Inf (every chunk sent has then been answered),
        Unavailable if a worker failed; then, and on any other exception (an interrupt), the pool is closed."""
        if not self.busy.acquire(blocking=False):  # another thread's tensor: this one goes to the threads
            raise Unavailable("the worker processes are busy")
        try:
            self._run(count, fill, collect)
        except _quantize4.NonFinite:
            raise
        except Unavailable:
            self.failed = True
            self.close(kill=True)
            raise
        except BaseException:
            self.close(kill=True)  # a chunk may still be in a worker: nothing of this pool is reused
            raise
        finally:
            self.busy.release()

    def _run(self, count: int, fill: Callable[[int, int], bytes], collect: Callable[[int, int, tuple], None]) -> None:
        free = [[w * self.slots + k for k in range(self.slots)] for w in range(self.size)]
        chunk_of: dict[int, int] = {}
        next_chunk, non_finite = 0, False
        waited = computed = 0.0
        started = time.perf_counter()
        while True:
            for w, slots in enumerate(free):  # every worker with a free slot gets its next chunk
                while slots and next_chunk < count and not non_finite:
                    slot = slots.pop()
                    self._send(w, fill(next_chunk, slot))
                    chunk_of[slot], next_chunk = next_chunk, next_chunk + 1
            if not chunk_of:
                break
            t = time.perf_counter()
            ready = self._selector.select()
            waited += time.perf_counter() - t
            for key, _ in ready:
                slot, status, err2, ref2, max_err, seconds = self._reply(key.fileobj.fileno())  # type: ignore[union-attr]
                computed += seconds
                if status == FAILED or slot not in chunk_of:
                    raise Unavailable(f"CPU kernel worker {key.data} failed (its error is above)")
                chunk = chunk_of.pop(slot)
                free[slot // self.slots].append(slot)
                if status == NON_FINITE:
                    non_finite = True  # no more chunks go out; those out are answered first
                elif not non_finite:
                    collect(chunk, slot, (err2, ref2, max_err))
                    self.chunks += 1
        # Where a tensor's time went: the workers' computing over their capacity says how well they were fed.
        trace.add("cpu-workers-wall", time.perf_counter() - started)
        trace.add("cpu-workers-computing", computed / self.size)
        trace.add("cpu-workers-feeder-waiting", waited)
        if non_finite:
            raise _quantize4.NonFinite("input holds NaN or Inf")

    def _send(self, worker: int, request: bytes) -> None:
        stdin = self._procs[worker].stdin
        try:
            stdin.write(request)  # type: ignore[union-attr]
            stdin.flush()  # type: ignore[union-attr]
        except (OSError, ValueError) as e:
            raise Unavailable(f"CPU kernel worker {worker} is gone ({e})") from None

    @staticmethod
    def _reply(fd: int) -> tuple:
        data = b""
        while len(data) < REPLY.size:
            part = os.read(fd, REPLY.size - len(data))
            if not part:
                raise Unavailable("a CPU kernel worker process ended")
            data += part
        return REPLY.unpack(data)

    def array(self, slot: int, region: str, dtype: np.dtype, count: int) -> np.ndarray:
        """A region of a slot as numpy (this process' view of the arena)."""
        return self.layout.array(self._map, slot, region, dtype, count)

    def close(self, kill: bool = False) -> None:
        """End the workers: closing their stdin ends them after their chunk; `kill` (or one that does not
        end within half a second) kills them."""
        self.broken = True
        for p in self._procs:
            if kill:
                p.kill()
            for pipe in (p.stdin, p.stdout):
                try:
                    pipe.close()  # type: ignore[union-attr]
                except OSError:
                    pass
        for p in self._procs:
            try:
                p.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self._procs = []
        self._selector.close()
        if self._fd >= 0:
            os.close(self._fd)  # the arena's pages go with the last mapping
            self._fd = -1


_lock = threading.Lock()
_pool: Pool | None = None
_failures = 0
atexit.register(close, kill=True)
