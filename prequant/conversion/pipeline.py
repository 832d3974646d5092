"""The streaming engine: read tensor i+1, quantize tensor i, write tensor i-1, all at once.

Three stages joined by small bounded queues, so at most a few tensors are in flight whatever the
model size:

    reader thread  ->  main thread (quantize)  ->  writer thread
    page-in / H2D       CPU kernel or CUDA,        pwrite into the shard,
                        async device-to-host       finalize shard when complete

On a GPU the reader copies the file through two fixed pinned buffers into a device tensor on its own
CUDA stream, and results come back into pinned buffers that torch's caching host allocator reuses, so host
memory stays at those buffers and the few tensors in flight. On the CPU the reader hands over zero-copy
memory-mapped views; `readahead` keeps the kernel reading the files ahead; the quantizing thread spreads
each tensor's quantization and statistics over the kernels' thread pool (`bnb.kernels._parallel`), so this
stage uses every core rather than one. Tensors kept as they are never enter this process: their values are
checked on the mapped view (one reduction over the pages the copy reads anyway), then the writer has the
kernel copy them file to file (copy_file_range). A tensor transformers loads in another dtype goes through
the quantizing device like a quantized one and is cast there.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import torch

from ..bnb.format import entry_key
from ..bnb.quantize import Quantizer
from ..checkpoint.dtypes import SAFETENSORS_DTYPES
from ..checkpoint.reader import TensorReader
from ..checkpoint.tensors import BIN_OFFSET
from ..util import trace
from .gpu_loader import GpuLoader
from .journal import Journal
from .plan import Plan, Step
from .shardset import FileSlice, ShardSet

IN_FLIGHT = 2  # tensors queued between stages


class _Stop(Exception):
    """Another stage failed; this one stops quietly and the first error is raised."""


class _Stage:
    """A bounded queue that gives up as soon as any stage has failed."""

    def __init__(self, failed: threading.Event, name: str, size: int = IN_FLIGHT) -> None:
        self._put_label, self._get_label = f"{name}-put-wait", f"{name}-get-wait"
        self._q: queue.Queue = queue.Queue(maxsize=size)
        self._failed = failed

    def put(self, item: object) -> None:
        with trace.busy(self._put_label):
            self._put(item)

    def get(self) -> object:
        with trace.busy(self._get_label):
            return self._get()

    def _put(self, item: object) -> None:
        while True:
            if self._failed.is_set():
                raise _Stop
            try:
                self._q.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def _get(self) -> object:
        while True:
            if self._failed.is_set():
                raise _Stop
            try:
                return self._q.get(timeout=0.1)
            except queue.Empty:
                continue


_END = object()

# inspect(step, source tensor, entries by short name ("weight", "absmax", ...)), on the quantizing device.
Inspect = Callable[[Step, torch.Tensor, dict[str, torch.Tensor]], None]
# check(name, kept tensor) -> (NaN, Inf) counts when not all finite; raises to refuse it (`kept.KeptCheck`).
Check = Callable[[str, torch.Tensor], "tuple[int, int] | None"]


def run(
    plan: Plan,
    source: TensorReader,
    quantizer: Quantizer,
    staging: Path,
    journal: Journal | None = None,
    on_step: Callable[[Step], None] = lambda step: None,
    inspect: Inspect | None = None,
    on_shard: Callable[[str, BinaryIO], None] = lambda name, file: file.close(),
    check: Check | None = None,
) -> dict[str, int]:
    """Convert every step of the plan into shards under `staging`; return each shard's tensor bytes.

    With a journal, finished work is recorded as it lands and work a previous run finished is skipped.
    `on_step` is called (from the writer thread) after each step's outputs are written, or at start for
    each step already done; `inspect(step, source, entries)` is called on the quantizing thread with both
    on the quantizing device (statistics are cheap there); `on_shard(name, file)` (writer thread) when a
    shard's bytes are all written, with the shard open for reading (the callee closes it), before its flush;
    `check(name, tensor)` on every kept tensor's values as written (its counts go into the journal).

    A tensor transformers would load in another dtype (`Decision.dtype`) is cast on the quantizing device first,
    one tensor at a time; a kept tensor that needs no cast never enters this process: its mapped view is checked
    in place, then the kernel copies its bytes.
    """
    failed = threading.Event()
    errors: list[BaseException] = []
    loaded, quantized = _Stage(failed, "loaded"), _Stage(failed, "quantized")
    shards = ShardSet(plan, staging, journal, on_shard)
    todo = [s for s in plan.steps if not shards.is_done(s)]
    for step in plan.steps:
        if shards.is_done(step):
            on_step(step)
    device = quantizer.device

    def guarded(fn: Callable[[], None]) -> Callable[[], None]:
        def body() -> None:
            try:
                fn()
            except _Stop:
                pass
            except BaseException as e:  # noqa: BLE001 - handed to the main thread
                errors.append(e)
                failed.set()

        return body

    def read_all() -> None:
        loader = GpuLoader(source, device) if device.type == "cuda" else None
        try:
            read_steps(loader)
        finally:
            if loader is not None:
                loader.close()
        loaded.put(_END)

    def read_steps(loader: GpuLoader | None) -> None:
        # No per-tensor advice: local files are read ahead by readahead.py, Hub shards were just written.
        for step in todo:
            source.prepare(step.source.file, failed)  # a Hub source: wait for the shard's download
            found = None
            if step.quantize or step.decision.dtype:  # through the quantizing device, to be quantized or cast
                data = loader.load(step.source) if loader is not None else (source.view(step.source), None)
            else:
                if check is not None:
                    with trace.busy("check-kept"):
                        found = check(step.source.name, source.view(step.source))
                if step.source.offset != BIN_OFFSET:
                    data = (FileSlice(source.fd(step.source.file), step.source.offset, step.source.nbytes), None)
                else:  # a .bin shard's tensor: no known byte range, written from its memory-mapped view
                    data = (source.view(step.source), None)
            loaded.put((step, data, found))

    def write_all() -> None:
        try:
            shards.finish_resumed()
            while (item := quantized.get()) is not _END:
                step, entries, copied, found = item  # type: ignore[misc]
                if copied is not None:
                    with trace.busy("device-to-host-wait"):
                        copied.synchronize()
                with trace.busy("write"):
                    shards.write(step, entries, found)
                del entries, item
                on_step(step)
        finally:
            shards.abort()

    threads = [threading.Thread(target=guarded(f), name=f"prequant-{f.__name__}") for f in (read_all, write_all)]
    for t in threads:
        t.start()
    try:
        guarded(lambda: _quantize_all(loaded, quantized, quantizer, inspect, check))()  # a failure sets `failed`
        for t in threads:
            t.join()
    except BaseException:
        # Interrupted while joining (Ctrl-C, SIGTERM): stop the other stages before the caller closes the
        # files they use; a writer left running could copy from a closed, reused descriptor.
        failed.set()
        for t in threads:
            t.join()
        raise
    if errors:
        raise errors[0]
    return shards.sizes


def _quantize_all(
    loaded: _Stage, quantized: _Stage, quantizer: Quantizer, inspect: Inspect | None, check: Check | None
) -> None:
    cuda = quantizer.device.type == "cuda"
    while (item := loaded.get()) is not _END:
        step, (tensor, ready), found = item  # type: ignore[misc]
        name = step.source.name
        if not step.quantize and not step.decision.dtype:
            quantized.put((step, {name: tensor}, None, found))
            continue
        if ready is not None:
            torch.cuda.current_stream(quantizer.device).wait_event(ready)
        if step.decision.dtype:  # the dtype transformers loads it in, as it casts it (torch's rounding)
            with trace.busy("cast"):
                tensor = tensor.to(SAFETENSORS_DTYPES[step.decision.dtype])
        if step.quantize:
            entries = _quantized(step, tensor, quantizer, inspect)
        else:
            if check is not None:
                with trace.busy("check-kept"):
                    found = check(name, tensor)
            entries = {name: tensor}
        copied = None
        if cuda:
            # Into pinned memory, asynchronously: this thread goes on to the next tensor while the copy runs,
            # and the writer waits for `copied`. Torch's caching host allocator reuses these buffers (it
            # holds each until the copy that used it has finished); the queue bounds how many are in use.
            with trace.busy("device-to-host"):
                host = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=True) for k, v in entries.items()}
                for k, v in entries.items():
                    host[k].copy_(v, non_blocking=True)
                copied = torch.cuda.Event()
                copied.record(torch.cuda.current_stream(quantizer.device))
                entries = host
        quantized.put((step, entries, copied, found))
        del tensor, entries, item
    quantized.put(_END)


def _quantized(step: Step, tensor: torch.Tensor, quantizer: Quantizer, inspect: Inspect | None) -> dict[str, torch.Tensor]:
    """A weight's checkpoint entries, by key; `inspect` sees them with the tensor as quantized."""
    x = tensor.t() if step.decision.transpose else tensor
    with trace.busy("quantize"):
        entries = quantizer(x, step.source.name)
    if inspect is not None:
        with trace.busy("stats"):
            inspect(step, x, entries)
    return {entry_key(step.source.name, k): v for k, v in entries.items()}
