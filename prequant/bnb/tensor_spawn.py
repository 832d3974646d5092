"""Starting the CPU tensor workers (`tensor_pool`, `tensor_worker`), and how many to start: standard library only.

A worker needs a second or two to import torch. The CLI therefore starts them (`start_early`) before it imports
torch itself, for a `--device cpu` conversion of a local checkpoint large enough to pay for them, and the pool
adopts them when the pipeline starts (`adopt`). A 16 GB Llama's 16 workers, started by the pool as the pipeline
started, were ready 3.0 s later, competing with the kernel's threads quantizing the first tensors; started here,
beside the CLI's own imports, 0.4-0.5 s after the pipeline started (`scripts/bench/convert.py --size-gb 16 --shape llama
--device cpu --warm-libraries`, the GPU machine, 2026-12-02).
"""

from __future__ import annotations

import atexit
import os
import socket
import subprocess
import sys
from pathlib import Path

from ..util import memory

ENV = "PREQUANT_CPU_WORKERS"
AUTO_MIN = 4  # fewer cores: the threads lose little to the GIL, and the workers' imports would not pay
# A worker's own memory, mostly its torch import: RssAnon 148 MiB with a CPU build of torch (the 2-core machine),
# 285 MiB with a CUDA build (the GPU machine).
WORKER_BYTES = 300 * 2**20
# Bytes to quantize, at least, for a conversion to start workers: they take a second or two to import torch, in
# which the threads of the caller's process quantize about as much (1.3 GB/s on 16 cores).
MIN_BYTES = 2 * 10**9

_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])  # the directory holding this prequant


def count(threads: int) -> int:
    """Workers for a process whose kernel would use `threads` threads: PREQUANT_CPU_WORKERS (a number; auto, the
    default: one per thread as far as an eighth of the available memory holds them, none below AUTO_MIN)."""
    text = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if text == "auto":
        n = min(threads, (memory.available() or 0) // 8 // WORKER_BYTES)
        return n if n >= AUTO_MIN and sys.platform == "linux" else 0
    try:
        return max(0, int(text))
    except ValueError:
        return 0  # tensor_pool.workers says so once torch is there


def spawn() -> tuple[subprocess.Popen, socket.socket]:
    """One worker process and this process' end of its socket (a datagram pair: one message per packet)."""
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    paths = (_PACKAGE_ROOT, os.environ.get("PYTHONPATH"))  # the workers import this same prequant
    # A worker starts no workers of its own, and neither torch nor the kernel may add threads in it.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p), "OMP_NUM_THREADS": "1", ENV: "0",
           "PREQUANT_CPU_PROCESSES": "0"}  # fmt: skip
    try:
        proc = subprocess.Popen([sys.executable, "-m", "prequant.bnb.tensor_worker", str(theirs.fileno())],
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, pass_fds=(theirs.fileno(),),
                                env=env)  # fmt: skip
    except BaseException:
        mine.close()
        raise
    finally:
        theirs.close()
    return proc, mine


_early: list[tuple[subprocess.Popen, socket.socket]] = []
_early_pid = 0


def start_early(weight_bytes: int, device: str) -> None:
    """From the CLI, before torch is imported: start the workers a conversion on the CPU (`_on_the_cpu`) of a local
    checkpoint whose weights weigh `weight_bytes` will use, if that is MIN_BYTES or more. Advisory: any problem leaves it to
    the pool."""
    global _early_pid
    if not _on_the_cpu(device) or _early or weight_bytes < MIN_BYTES:
        return
    try:
        threads = int(os.environ.get("OMP_NUM_THREADS") or len(os.sched_getaffinity(0)))
        _early_pid = os.getpid()
        for _ in range(count(threads)):
            _early.append(spawn())
    except Exception:  # noqa: BLE001, S110 - advisory: the pool starts its own
        pass


# What a GPU torch could use leaves one of these behind (NVIDIA's driver; AMD's, for ROCm builds).
GPU_DEVICES = ("/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd")


def _on_the_cpu(device: str) -> bool:
    """Whether a conversion with this --device will quantize on the CPU, as far as the CLI can tell before torch:
    `cpu`, or `auto` on a machine with no GPU device at all. (A wrong guess costs only the workers' start-up.)"""
    return device == "cpu" or (device == "auto" and not any(os.path.exists(p) for p in GPU_DEVICES))


def adopt(n: int) -> list[tuple[subprocess.Popen, socket.socket]]:
    """Up to `n` of the workers `start_early` started, for the pool; the rest are ended."""
    if _early_pid != os.getpid():  # a forked child: they are its parent's
        _early.clear()
    taken, rest = _early[:n], _early[n:]
    _early.clear()
    for proc, sock in rest:
        proc.kill()
        sock.close()
        proc.wait()
    return taken


def _end_unadopted() -> None:
    adopt(0)


atexit.register(_end_unadopted)
