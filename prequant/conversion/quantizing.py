"""The pipeline's middle stage: each loaded tensor quantized, cast or passed on, in plan order.

On a GPU a tensor is quantized on the device, then copied back into pinned memory asynchronously while this thread
goes on to the next one. On the CPU, where there are enough cores (`bnb.tensor_pool`), several tensors are in
flight at once, one per worker process, and are handed on in plan order as they come back; what a worker cannot
take (a small or cast tensor, a `.bin` shard's, or any tensor while the workers are still starting) is quantized here,
on the kernel's threads. Either way the bytes and the statistics are the same. A conversion on a GPU whose CUDA is
still starting (`bnb.starting`) quantizes the tensors read meanwhile here on the CPU, with the same bytes.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Protocol

import torch

from ..bnb import tensor_pool
from ..bnb.format import entry_key
from ..bnb.quantize import Quantizer
from ..bnb.starting import Starting
from ..bnb.stats import TensorStats
from ..checkpoint.dtypes import SAFETENSORS_DTYPES
from ..util import trace
from .plan import Step
from .stages import END, IN_FLIGHT, Stage


class Stats(Protocol):
    """Where each quantized tensor's statistics go (`bnb.stats.Collector`)."""

    def inspect(self, step: Step, source: torch.Tensor, entries: dict[str, torch.Tensor]) -> None:
        """Measure them from the entries (short names: weight, absmax, ...) and the tensor as quantized."""

    def add(self, step: Step, stats: TensorStats) -> None:
        """Take them as a worker process measured them."""


def quantize_all(loaded: Stage, quantized: Stage, quantizer: Quantizer | Starting, stats: Stats | None, check,
                 work_bytes: int) -> None:  # fmt: skip
    """Take (step, (tensor, ready event), found) items from `loaded` until END; put (step, entries, copied event,
    found) items into `quantized`, in the same order, then END. `work_bytes`: what is to be quantized (whether
    worker processes would pay)."""
    pool = tensor_pool.pool(work_bytes) if quantizer.device_type == "cpu" else None
    if pool is not None and pool.owner.acquire(blocking=False):  # else another thread's conversion has it
        try:
            _with_workers(loaded, quantized, quantizer, pool, stats, check)
        finally:
            pool.owner.release()
    else:
        while (item := loaded.get()) is not END:
            step, (tensor, ready), found = item  # type: ignore[misc]
            quantized.put(_here(step, tensor, ready, found, quantizer, stats, check))
            del item, tensor
    quantized.put(END)


@dataclass
class _Pending:
    """One item on its way to the writer, in plan order: `result` is the writer's item once known (at once for one
    done here; a worker's once its job is answered)."""

    step: Step
    tensor: torch.Tensor
    job: tensor_pool.Job | None
    found: object
    result: tuple | None = None


def _with_workers(loaded: Stage, quantized: Stage, quantizer: Quantizer, pool: tensor_pool.Pool, stats: Stats | None,
                  check) -> None:  # fmt: skip
    # Why the writer is offered items rather than waited for: while this thread waits for the writer (a shard's
    # writes held up by the disk, a kept tensor copied), no worker gets its next tensor, and once the writer is
    # free it waits in turn for tensors just sent. On the GPU machine's 16 GB Llama this thread waited 8.4 s for
    # the writer and the writer 5.4 s for it (`scripts/bench/convert.py --size-gb 16 --shape llama --device cuda
    # --also-device cpu --warm-libraries`, 2026-12-02). So finished items wait here, up to `most`, while the
    # workers go on; the wait for the writer comes only past that. The writer then waited 2.6 s (the same command:
    # 19.6 s, 1.40x the floor, then 16.1 s, 1.38x, on another lease).
    pending: deque[_Pending] = deque()
    most = pool.size * tensor_pool.JOBS_PER_WORKER + IN_FLIGHT

    def hand_over(block: bool) -> bool:
        """Pass the oldest item on once it is done and the writer has room (waiting for both if `block`); whether
        one was passed."""
        item = pending[0]
        if item.result is None:
            job = item.job
            if not block:
                pool.poll()
                if not job.done:
                    return False
            pool.wait(job)
            if job.entries is None:  # the worker could not: here, where any error is the user's to see
                item.result = _here(item.step, item.tensor, None, item.found, quantizer, stats, check)
            else:
                if stats is not None and job.stats is not None:
                    stats.add(item.step, job.stats)
                entries = {entry_key(item.step.source.name, k): v for k, v in job.entries.items()}
                item.result = (item.step, entries, None, item.found)
        if block:
            quantized.put(item.result)
        elif not quantized.offer(item.result):
            return False
        if item.job is not None:
            pool.release(item.job)  # its entries are the writer's now
        pending.popleft()
        return True

    def pass_on() -> None:
        """Pass on what is done, as far as the writer takes it; past `most` items, wait for the oldest."""
        while pending:
            if len(pending) > most:
                hand_over(block=True)
            elif not hand_over(block=False):
                break

    try:
        while (loaded_item := loaded.get()) is not END:
            step, (tensor, _ready), found = loaded_item  # type: ignore[misc]
            del loaded_item
            job = None
            if step.quantize and not step.decision.dtype:
                while pool.full() and pool.busy():  # every worker has its tensors: wait until one answers
                    pool.wait_any()
                    pass_on()
                job = pool.take(tensor, step.source.name, quantizer.settings, stats is not None, step.decision.transpose)
            item = _Pending(step, tensor, job, found)
            if job is None:  # anything a worker does not take is done now
                item.result = _here(step, tensor, None, found, quantizer, stats, check)
            pending.append(item)
            del tensor, item
            pass_on()
        while pending:
            hand_over(block=True)
    except BaseException:
        if pool.busy():  # a tensor may still be in a worker: nothing of this pool is reused
            pool.close(kill=True)
        raise


def _here(step: Step, tensor: torch.Tensor, ready: torch.cuda.Event | None, found: object,
          quantizer: Quantizer | Starting, stats: Stats | None, check) -> tuple:  # fmt: skip
    """One item for the writer, computed in this process."""
    name = step.source.name
    if not step.quantize and not step.decision.dtype:
        return (step, {name: tensor}, None, found)
    q = quantizer.on(tensor.device)  # the CPU's for a tensor read while CUDA was starting (`bnb.starting`)
    if ready is not None:
        torch.cuda.current_stream(q.device).wait_event(ready)
    if step.decision.dtype:  # the dtype transformers loads it in, as it casts it (torch's rounding)
        with trace.busy("cast"):
            tensor = tensor.to(SAFETENSORS_DTYPES[step.decision.dtype])
    if step.quantize:
        entries = _quantized(step, tensor, q, stats, early=q.device_type != quantizer.device_type)
    else:
        if check is not None:
            with trace.busy("check-kept"):
                found = check(name, tensor)
        entries = {name: tensor}
    copied = None
    if q.device_type == "cuda":
        # Into pinned memory, asynchronously: this thread goes on to the next tensor while the copy runs,
        # and the writer waits for `copied`. Torch's caching host allocator reuses these buffers (it
        # holds each until the copy that used it has finished); the queue bounds how many are in use.
        with trace.busy("device-to-host"):
            host = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=True) for k, v in entries.items()}
            for k, v in entries.items():
                host[k].copy_(v, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(torch.cuda.current_stream(q.device))
            entries = host
    return (step, entries, copied, found)


def _quantized(step: Step, tensor: torch.Tensor, quantizer: Quantizer, stats: Stats | None,
               early: bool = False) -> dict[str, torch.Tensor]:  # fmt: skip
    """A weight's checkpoint entries, by key; `stats` sees them with the tensor as quantized. `early`: on the CPU
    while CUDA starts (traced apart)."""
    x = tensor.t() if step.decision.transpose else tensor
    with trace.busy("quantize-while-cuda-starts" if early else "quantize"):
        entries = quantizer(x, step.source.name)
    if stats is not None:
        with trace.busy("stats"):
            stats.inspect(step, x, entries)
    return {entry_key(step.source.name, k): v for k, v in entries.items()}
