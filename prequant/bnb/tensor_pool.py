"""Whole tensors quantized on worker processes, several at once, so that a CPU conversion uses every core.

Why whole tensors: inside one process the CPU kernel's threads share one GIL, and on 16 cores its hand-overs cost
more than the work (the kernel made 1.65-1.80 GB/s on 16 threads against 0.415 on one). Splitting each tensor into
chunks for worker processes (`kernels._procs`) still runs kernel, double quantization and statistics one after
another per tensor, with the workers idle in between. Here each worker (`tensor_worker`) takes a whole tensor
through all of it, single-threaded, the way the conversion's own process would; with one tensor per core in
flight, nothing waits for anything but the disk.

What crosses: a request names the tensor by its file, offset, device and inode (a source view mapped from a file:
`kernels._wire.file_origin`), so each worker reads its tensor from the page cache itself; the reply brings a memfd
holding the entries (`encode_entries`), which this process maps, so they cross without a copy. Bytes and
statistics are the in-process ones: the same functions compute them from the same values (`tests/bnb/test_tensor_pool.py`).

The pool starts without waiting: a worker takes tensors once it has imported torch (a second or two); until then,
and for whatever a worker cannot take (a cast, a transposed weight, a small tensor), the caller quantizes in its own
process. A worker's failure costs no result: its tensors come back as None and the caller redoes them.

On by default where it pays (PREQUANT_CPU_WORKERS=auto: one per thread of `kernels._parallel.threads()`, as far as an
eighth of the available memory holds them, none below 4 cores; `tensor_spawn`), for conversions with at least
`tensor_spawn.MIN_BYTES` to quantize; a number sets the count, 0 turns it off.
"""

from __future__ import annotations

import atexit
import collections
import json
import logging
import os
import select
import socket
import subprocess
import threading

import torch

from ..checkpoint.dtypes import TORCH_TO_SAFETENSORS
from ..util import memory, trace
from . import tensor_spawn
from .format import Settings
from .kernels import _parallel, _wire
from .stats import TensorStats
from .tensor_wire import READY, decode_entries

log = logging.getLogger(__name__)

COUNT: int | None = None  # workers; None: as PREQUANT_CPU_WORKERS says (`tensor_spawn.count`; tests set it)
ENV = tensor_spawn.ENV
MIN_ELEMENTS = 1 << 20  # smaller tensors stay in the caller's process (a few milliseconds there)
JOBS_PER_WORKER = 2  # a worker finds its next tensor waiting when it finishes one
# Memory a tensor's job holds until the caller hands its entries on, per element: the worker's packed codes and
# absmax while it quantizes, and the memfd they are copied into (about 0.57 bytes per element each).
BYTES_PER_ELEMENT = 1.2

_FLOAT = (torch.bfloat16, torch.float16, torch.float32)


def workers() -> int:
    """Worker processes a conversion on the CPU uses now: COUNT, else PREQUANT_CPU_WORKERS (a number, or auto, the
    default: `tensor_spawn.count` for the kernel's threads)."""
    if COUNT is not None:
        return max(0, COUNT)
    text = os.environ.get(ENV, "auto").strip().lower()
    if text not in ("", "auto") and not text.isdigit():
        log.warning("%s=%r is neither a number of processes nor auto; quantizing in this process", ENV, text)
    return tensor_spawn.count(_parallel.threads())


class Job:
    """One tensor on a worker: `entries` (short names, as `Quantizer` returns them) and `stats` once done; both
    None when the worker could not do it (then the caller quantizes it)."""

    def __init__(self, worker: int, cost: int) -> None:
        self.worker, self.cost = worker, cost
        self.done = False
        self.entries: dict[str, torch.Tensor] | None = None
        self.stats: TensorStats | None = None


class _Worker:
    def __init__(self, proc: subprocess.Popen, sock: socket.socket) -> None:
        self.proc, self.sock = proc, sock
        self.ready = False
        self.jobs: collections.deque[Job] = collections.deque()


class Pool:
    """`size` tensor workers, started without waiting; one caller thread at a time."""

    def __init__(self, size: int) -> None:
        self.pid, self.size = os.getpid(), size
        # Held by the conversion using the pool: another thread's conversion quantizes in its own process
        # meanwhile, and `close()` waits for it (the sockets must not close under it).
        self.owner = threading.Lock()
        self.broken = self.failed = False  # closed; closed because a worker failed
        self.tensors = 0  # done by the workers, all conversions together
        self.budget = max(1, (memory.available() or 0) // 4)  # bytes the jobs in flight may hold
        self.held = 0
        # Those the CLI started before torch was imported, then as many more as needed.
        self._workers = [_Worker(proc, sock) for proc, sock in tensor_spawn.adopt(size)]
        try:
            while len(self._workers) < size:
                self._workers.append(_Worker(*tensor_spawn.spawn()))
        except BaseException:
            self.close(kill=True)
            raise

    def take(self, x: torch.Tensor, name: str, settings: Settings, want_stats: bool, transpose: bool = False) -> Job | None:
        """Send `x` (quantized as `x.t()` if `transpose`, as a Conv1D weight is) to a ready worker with room, or
        None: the caller quantizes it (too small, not a mapped file's bytes, no worker ready or free, the memory
        budget spent, the pool broken)."""
        if self.broken or x.dtype not in _FLOAT or x.numel() < MIN_ELEMENTS:
            return None
        self.poll()
        cost = int(x.numel() * BYTES_PER_ELEMENT)
        free = [w for w in self._workers if w.ready and len(w.jobs) < JOBS_PER_WORKER]
        if not free or (self.held and self.held + cost > self.budget):
            return None
        origin = _wire.file_origin(x)
        if origin is None:
            return None
        worker = min(free, key=lambda w: len(w.jobs))
        request = {"path": os.fsdecode(origin.path), "offset": origin.offset, "device": origin.device,
                   "inode": origin.inode, "dtype": TORCH_TO_SAFETENSORS[x.dtype], "numel": x.numel(),
                   "shape": list(x.shape), "transpose": transpose, "name": name, "settings": settings.__dict__,
                   "stats": want_stats}  # fmt: skip
        job = Job(self._workers.index(worker), cost)
        try:
            worker.sock.send(json.dumps(request).encode())
        except OSError as e:
            self._break(f"a CPU worker is gone ({e})")
            return None
        worker.jobs.append(job)
        self.held += cost
        return job

    def wait_ready(self) -> bool:
        """Block until every worker is ready (benchmarks and tests); whether the pool is still whole."""
        while not self.broken and not all(w.ready for w in self._workers):
            self._pump(block=True)
        return not self.broken

    def busy(self) -> bool:
        """Whether any job is still out."""
        return any(w.jobs for w in self._workers)

    def full(self) -> bool:
        """Whether no ready worker has room (take would return None for want of one)."""
        self.poll()
        return not any(w.ready and len(w.jobs) < JOBS_PER_WORKER for w in self._workers)

    def wait(self, job: Job) -> Job:
        """Block until `job` is answered (or the pool broke: then its entries are None)."""
        with trace.busy("cpu-workers-wait"):
            while not job.done:
                self._pump(block=True)
        return job

    def wait_any(self) -> None:
        """Block until some worker says something (a job answered, a worker ready) or the pool breaks."""
        with trace.busy("cpu-workers-wait"):
            self._pump(block=True)

    def release(self, job: Job) -> None:
        """The caller has handed `job`'s entries on: their memory no longer counts against the budget."""
        self.held -= job.cost
        job.cost = 0

    def poll(self) -> None:
        """Read whatever the workers have said so far, without waiting."""
        self._pump(block=False)

    def _pump(self, block: bool) -> None:
        listening = [w for w in self._workers if w.jobs or not w.ready]
        if self.broken or not listening:
            return
        said, _, _ = select.select([w.sock for w in listening], [], [], None if block else 0)
        for w in listening:
            if w.sock in said:
                self._read(w)

    def _read(self, w: _Worker) -> None:
        try:
            body, fds, _, _ = socket.recv_fds(w.sock, 1 << 16, 1)
        except OSError as e:
            body, fds = b"", []
            log.debug("CPU worker socket: %s", e)
        if not body:
            self._break("a CPU worker process ended")
            return
        if not w.ready:
            w.ready = body == READY
            if not w.ready:
                self._break("a CPU worker said something other than that it was ready")
            elif all(x.ready for x in self._workers):
                trace.mark("cpu-workers-ready")
            return
        job, reply = w.jobs.popleft(), json.loads(body)
        job.done = True
        trace.add("cpu-workers-computing", reply.get("seconds", 0.0) / self.size)
        if "error" in reply:
            log.debug("CPU worker %d: %s (the tensor is redone in this process)", job.worker, reply["error"])
            return
        job.entries = decode_entries(fds[0], reply["entries"])
        job.stats = None if reply["stats"] is None else TensorStats(**reply["stats"])
        self.tensors += 1

    def _break(self, why: str) -> None:
        log.warning("%s; quantizing in this process", why)
        self.failed = True
        self.close(kill=True)

    def close(self, kill: bool = False) -> None:
        """End the workers (closing their sockets ends them; `kill`, or one still running after half a second, is
        killed). Jobs still out are answered with None."""
        self.broken = True
        for w in self._workers:
            for job in w.jobs:
                job.done = True
            w.jobs.clear()
            if kill:
                w.proc.kill()
            w.sock.close()
        for w in self._workers:
            try:
                w.proc.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                w.proc.kill()
                w.proc.wait()
        self._workers = []


_pool: Pool | None = None
_failures = 0
MAX_FAILURES = 3  # pools broken, at most: then this process quantizes in its own


def pool(work_bytes: int | None = None) -> Pool | None:
    """The process' pool (started on the first call, not waited for), or None where it is off, keeps failing, or
    has too little to do (`work_bytes` below `tensor_spawn.MIN_BYTES`, unless a pool is running already)."""
    global _pool, _failures
    count = workers()
    if work_bytes is not None and work_bytes < tensor_spawn.MIN_BYTES and (_pool is None or _pool.broken):
        return None
    if _pool is not None and (_pool.pid != os.getpid() or _pool.broken or _pool.size != count):
        if _pool.pid == os.getpid():
            _failures += _pool.failed
            _pool.close()
        _pool = None
    if _pool is None and count and _failures < MAX_FAILURES:
        try:
            _pool = Pool(count)
        except OSError as e:  # no socketpair, no python executable...: this process does it
            log.debug("no CPU workers: %s", e)
            _failures = MAX_FAILURES
    return _pool


def close() -> None:
    """End the process' pool once no conversion uses it (convert() at its end; tests; at exit, killed: the workers
    hold nothing worth waiting for). A conversion of another thread still using it keeps it."""
    global _pool
    current = _pool
    if current is None or current.pid != os.getpid():
        _pool = None
        return
    if not current.owner.acquire(blocking=False):
        return  # that conversion's own close() ends it
    try:
        current.close(kill=True)
        if _pool is current:
            _pool = None
    finally:
        current.owner.release()


atexit.register(close)
