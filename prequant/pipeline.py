"""The streaming engine: read tensor i+1, quantize tensor i, write tensor i-1, all at once.

Three stages joined by small bounded queues, so at most a few tensors are in flight whatever the
model size:

    reader thread  ->  main thread (quantize)  ->  writer thread
    page-in / H2D       CPU kernel or CUDA         pwrite into the shard,
                        + device-to-host           finalize shard when complete

On a GPU the reader copies the file through two fixed pinned buffers into a device tensor on its own
CUDA stream, so host memory stays at those two buffers. On the CPU the reader hands over zero-copy
memory-mapped views and asks the kernel to read the next tensor ahead. Tensors kept as they are never
leave the memory map: the writer writes them straight from it.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from .dtypes import SAFETENSORS_DTYPES
from .plan import Plan, Step
from .quantize import Quantizer
from .reader import TensorRef, TensorSource
from .writer import ShardWriter

CHUNK_BYTES = 64 * 1024 * 1024  # pinned staging buffer size for host-to-device copies
IN_FLIGHT = 2  # tensors queued between stages


class _Stop(Exception):
    """Another stage failed; this one stops quietly and the first error is raised."""


class _Stage:
    """A bounded queue that gives up as soon as any stage has failed."""

    def __init__(self, failed: threading.Event, size: int = IN_FLIGHT) -> None:
        self._q: queue.Queue = queue.Queue(maxsize=size)
        self._failed = failed

    def put(self, item: object) -> None:
        while True:
            if self._failed.is_set():
                raise _Stop
            try:
                self._q.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def get(self) -> object:
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


def run(
    plan: Plan,
    source: TensorSource,
    quantizer: Quantizer,
    staging: Path,
    on_step: Callable[[Step], None] = lambda step: None,
    skip_steps: frozenset[str] = frozenset(),
    inspect: Inspect | None = None,
    on_shard: Callable[[Path], None] = lambda path: None,
) -> dict[str, int]:
    """Convert every step of the plan into shards under `staging`; return each shard's tensor bytes.

    `on_step` is called (from the writer thread) after each step's outputs are written; steps whose
    source name is in `skip_steps` are taken as already done (resume). `inspect(step, source, entries)`
    is called on the quantizing thread with both on the quantizing device (statistics are cheap there);
    `on_shard(path)` (writer thread) when a shard file is complete."""
    failed = threading.Event()
    errors: list[BaseException] = []
    loaded, quantized = _Stage(failed), _Stage(failed)
    sizes: dict[str, int] = {}
    todo = [s for s in plan.steps if s.source.name not in skip_steps]
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
        loader = _GpuLoader(source, device) if device.type == "cuda" else None
        for i, step in enumerate(todo):
            if i + 1 < len(todo):
                source.advise_willneed(todo[i + 1].source)
            if step.quantize and loader is not None:
                loaded.put((step, loader.load(step.source)))
            else:
                loaded.put((step, (source.view(step.source), None)))
        loaded.put(_END)

    def write_all() -> None:
        writers: dict[str, ShardWriter] = {}
        try:
            while (item := quantized.get()) is not _END:
                step, entries = item  # type: ignore[misc]
                writer = writers.get(step.shard)
                if writer is None:
                    writer = writers[step.shard] = _open_shard(plan, step.shard, staging)
                for key, tensor in entries.items():
                    writer.write(key, tensor)
                del entries, item
                if writer.done:
                    on_shard(writer.finalize())
                    sizes[step.shard] = writer.data_bytes
                    del writers[step.shard]
                on_step(step)
        finally:
            for w in writers.values():
                w.abort()

    threads = [threading.Thread(target=guarded(f), name=f"prequant-{f.__name__}") for f in (read_all, write_all)]
    for t in threads:
        t.start()
    try:
        guarded(lambda: _quantize_all(loaded, quantized, quantizer, inspect))()
    finally:
        if errors:
            failed.set()
        for t in threads:
            t.join()
    if errors:
        raise errors[0]
    return sizes


def _quantize_all(loaded: _Stage, quantized: _Stage, quantizer: Quantizer, inspect: Inspect | None) -> None:
    cuda = quantizer.device.type == "cuda"
    while (item := loaded.get()) is not _END:
        step, (tensor, ready) = item  # type: ignore[misc]
        if not step.quantize:
            quantized.put((step, {step.source.name: tensor}))
            continue
        if ready is not None:
            torch.cuda.current_stream(quantizer.device).wait_event(ready)
        x = tensor.t() if step.decision.transpose else tensor
        entries = quantizer(x, step.source.name)
        if inspect is not None:
            inspect(step, x, entries)
        if cuda:
            # Synchronous device-to-host: the writer needs host bytes, and its queue bounds what waits.
            entries = {k: v.cpu() for k, v in entries.items()}
        prefix = step.source.name
        quantized.put((step, {prefix if k == "weight" else f"{prefix}.{k}": v for k, v in entries.items()}))
        del tensor, x, entries, item
    quantized.put(_END)


def _open_shard(plan: Plan, shard: str, staging: Path) -> ShardWriter:
    entries = [o for s in plan.steps if s.shard == shard for o in s.outputs]
    return ShardWriter(staging / shard, entries)


class _GpuLoader:
    """Copies a tensor from its file to the GPU through two pinned buffers, on a side stream."""

    def __init__(self, source: TensorSource, device: torch.device) -> None:
        self.source, self.device = source, device
        self.stream = torch.cuda.Stream(device)
        self.buffers = [torch.empty(CHUNK_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        self.events = [torch.cuda.Event() for _ in range(2)]
        for ev in self.events:
            ev.record(self.stream)

    def load(self, ref: TensorRef) -> tuple[torch.Tensor, torch.cuda.Event]:
        out = torch.empty(ref.nbytes, dtype=torch.uint8, device=self.device)
        # `out` may reuse memory the default stream was still reading: order the copies after that work.
        self.stream.wait_stream(torch.cuda.default_stream(self.device))
        with torch.cuda.stream(self.stream):
            for i, start in enumerate(_chunks(ref.nbytes)):
                buf, ev = self.buffers[i % 2], self.events[i % 2]
                ev.synchronize()  # the previous copy out of this buffer has finished
                n = min(CHUNK_BYTES, ref.nbytes - start)
                self.source.read_into(ref, start, memoryview(buf.numpy())[:n])
                out[start : start + n].copy_(buf[:n], non_blocking=True)
                ev.record(self.stream)
            done = torch.cuda.Event()
            done.record(self.stream)
        return out.view(SAFETENSORS_DTYPES[ref.dtype]).view(ref.shape), done


def _chunks(nbytes: int) -> Iterator[int]:
    return iter(range(0, nbytes, CHUNK_BYTES))
