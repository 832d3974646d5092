"""The stream: read tensor i+1, quantize tensor i, write tensor i-1, all at once, with a bounded number of tensors
in flight whatever the model size.

    reader thread  ->  main thread (quantize)  ->  writer thread
    page-in / H2D      CPU kernel or CUDA,         pwrite into the shard,
                       async device-to-host        finalize the shard when complete

The stages are joined by small bounded queues (`Stage`). On a GPU the reader copies the file through two fixed pinned
buffers into a device tensor on its own CUDA stream (`GpuLoader`), and results come back into pinned buffers that
torch's caching host allocator reuses, so host memory stays at those buffers and the few tensors in flight. On the
CPU the reader hands over zero-copy memory-mapped views, which the CPU kernel quantizes on its threads
(`bnb.kernels._parallel`). Tensors kept as they are never enter the quantizing stage's memory: a thread of their own
asks for their pages and checks their values on the mapped view while the reader goes on, then the writer, once the
check has passed, has the kernel copy them file to file (copy_file_range). A tensor transformers loads in another
dtype goes through the quantizing device like a quantized one and is cast there. So does a weight stored quantized
(FP8, INT4, MXFP4), quantized or kept: its codes and scales travel to the device as stored (a half or a quarter of
the bytes of its 16-bit form) and are dequantized there (`checkpoint.quantized.dequantize`), on the CPU over the
kernel's threads. The writer stage (`ShardSet`) opens each output shard on its first tensor, finalizes it when its
last one is written, and journals both.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Protocol

import torch

from ..bnb.format import entry_key
from ..bnb.kernels import _parallel
from ..bnb.quantize import Quantizer
from ..bnb.starting import Starting, ready
from ..checkpoint.dtypes import SAFETENSORS_DTYPES
from ..checkpoint.quantized import check_stored, dequantize, read_with
from ..checkpoint.reader import TensorReader
from ..checkpoint.tensors import BIN_OFFSET, QuantizedWeight, TensorRef
from ..util import failpoints, pagecache, trace
from .follow_hash import FollowHash
from .journal import Journal
from .plan import Plan, Step
from .writer import ShardWriter

IN_FLIGHT = 2  # tensors queued between two stages: each finds its next one waiting, and memory stays bounded
CHUNK_BYTES = 64 * 1024 * 1024  # each of the two pinned buffers a tensor goes to the GPU through
# Threads filling one pinned buffer: one thread copies from the page cache more slowly than a read-ahead source
# delivers; the copies (preadv) run without the GIL.
READ_THREADS = 4

# check(name, kept tensor) -> (NaN, Inf) counts when not all finite; raises to refuse it (`record.KeptCheck`).
Check = Callable[[str, torch.Tensor], "tuple[int, int] | None"]


class Transform(Protocol):
    """A change to some source tensors on the quantizing device before they are quantized or written (a merge's
    `merging.run.Merger`): the result then takes the path a source tensor of its dtype takes."""

    def applies(self, step: Step) -> bool:
        """Whether `step`'s tensor is changed."""

    def __call__(self, step: Step, tensor: torch.Tensor) -> torch.Tensor:
        """The changed tensor, on `tensor`'s device."""


class Stats(Protocol):
    """Where each quantized tensor's statistics go (`bnb.stats.Collector`)."""

    def inspect(self, step: Step, source: torch.Tensor, entries: dict[str, torch.Tensor]) -> None:
        """Measure them from the entries (short names: weight, absmax, ...) and the tensor as quantized."""


def run(
    plan: Plan,
    source: TensorReader,
    quantizer: Quantizer | Starting,
    staging: Path,
    journal: Journal | None = None,
    on_step: Callable[[Step], None] = lambda step: None,
    stats: Stats | None = None,
    on_shard: Callable[[str, BinaryIO], None] = lambda name, file: file.close(),
    check: Check | None = None,
    on_follow: Callable[[str, FollowHash], None] | None = None,
    transform: Transform | None = None,
) -> dict[str, int]:
    """Convert every step of the plan into shards under `staging`; return each shard's tensor bytes.

    A quantizer still starting (`bnb.starting.Starting`) is waited for by the first tensor that needs it: the kept
    tensors before it are written meanwhile. With a journal, finished work is
    recorded as it lands and work a previous run finished is skipped. `on_step` is called (from the writer thread)
    after each step's outputs are written, or at start for each step already done; `stats` measures each quantized
    tensor on the quantizing device; `on_shard(name, file)` (writer thread) when a shard's bytes are all written,
    with the shard open for reading (the callee closes it), before its flush; `check(name, tensor)` on every kept
    tensor's values as written (its counts go into the journal); `on_follow(name, hash)` (writer thread) when a
    shard whose header is already known opens: `hash.run()` gives its sha256 as it is written (`follow_hash`), and
    `on_shard` then only closes that shard's file. `transform` changes the tensors it applies to on the quantizing
    device, after any cast and before quantizing.

    A tensor transformers would load in another dtype (`Decision.dtype`) is cast on the quantizing device first,
    one tensor at a time; a kept tensor that needs no cast never enters this process: its mapped view is checked
    in place, then the kernel copies its bytes.
    """
    failed = threading.Event()
    errors: list[BaseException] = []
    loaded, quantized = Stage(failed, "loaded"), Stage(failed, "quantized")
    shards = ShardSet(plan, staging, journal, on_shard, on_follow)
    todo = [s for s in plan.steps if not shards.is_done(s)]
    for step in plan.steps:
        if shards.is_done(step):
            on_step(step)

    def guarded(fn: Callable[[], None]) -> Callable[[], None]:
        def body() -> None:
            try:
                fn()
            except Stop:
                pass
            except BaseException as e:  # noqa: BLE001 - handed to the main thread
                errors.append(e)
                failed.set()

        return body

    loader: GpuLoader | None = None  # made by the reader's first tensor for a CUDA quantizer
    # Kept tensors are checked on a thread of their own, in order, and the writer waits for each one's result
    # before writing it: a check reads its tensor cold when the read-ahead has not reached it, and done on the
    # reader it would hold up the tensors to quantize behind it.
    checks = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prequant-check") if check is not None else None

    def check_kept(ref: TensorRef) -> tuple[int, int] | None:
        """A kept tensor's check, its pages asked for first in large asynchronous requests: through the mapped
        view each page fault is a small read that waits behind everything queued before it."""
        assert check is not None
        with trace.busy("check-kept"):
            if ref.offset != BIN_OFFSET:
                pagecache.will_need(source.fd(ref.file), ref.offset, ref.nbytes)
            return check(ref.name, source.view(ref))

    def load(ref: TensorRef) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """A tensor on the quantizing device, and the event its copy there records (None on the CPU: a view)."""
        nonlocal loader
        if loader is None and ready(quantizer).device.type == "cuda":
            loader = GpuLoader(source, ready(quantizer).device)
        return loader.load(ref) if loader is not None else (source.view(ref), None)

    def read_all() -> None:
        try:
            for step in todo:
                source.prepare(step.source.file, failed)  # a Hub source: wait for the shard's download
                found = None
                changed = transform is not None and transform.applies(step)
                if isinstance(step.source, QuantizedWeight):  # its stored tensors, dequantized on the device
                    parts = read_with(step.source)
                    for part in (*parts[1:], *step.source.checked):
                        source.prepare(part.file, failed)
                    check_stored(step.source, source.view)  # on the CPU: no device round trip
                    loads = [load(part) for part in parts]
                    data = (tuple(t for t, _ in loads), loads[-1][1])  # each copy follows the one before on the stream
                elif step.quantize or step.decision.dtype or changed:  # through the quantizing device
                    data = load(step.source)
                else:
                    if checks is not None:
                        found = checks.submit(check_kept, step.source)
                    if step.source.offset != BIN_OFFSET:
                        data = (FileSlice(source.fd(step.source.file), step.source.offset, step.source.nbytes), None)
                    else:  # a .bin shard's tensor: no known byte range, written from its memory-mapped view
                        data = (source.view(step.source), None)
                loaded.put((step, data, found))
        finally:
            if loader is not None:
                loader.close()
        loaded.put(END)

    def quantize_all() -> None:
        while (item := loaded.get()) is not END:
            step, (tensor, copied), found = item  # type: ignore[misc]
            quantized.put(_transform(step, tensor, copied, found, quantizer, stats, check, transform))
            del item, tensor
        quantized.put(END)

    def write_all() -> None:
        try:
            shards.finish_resumed()
            while (item := quantized.get()) is not END:
                step, entries, copied, found = item  # type: ignore[misc]
                if isinstance(found, Future):  # a kept tensor's check: its NaN refusal stops the run here
                    with trace.busy("check-kept-wait"):
                        found = found.result()
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
        guarded(quantize_all)()  # a failure sets `failed`
        for t in threads:
            t.join()
    except BaseException:
        # Interrupted while joining (Ctrl-C, SIGTERM): stop the other stages before the caller closes the
        # files they use; a writer left running could copy from a closed, reused descriptor.
        failed.set()
        for t in threads:
            t.join()
        raise
    finally:
        if checks is not None:  # no check may go on reading a mapped view once the caller closes the files
            checks.shutdown(wait=True, cancel_futures=True)
    if errors:
        raise errors[0]
    return shards.sizes


def _transform(step: Step, tensor: torch.Tensor | tuple[torch.Tensor, torch.Tensor], loaded: torch.cuda.Event | None,
               found: object, quantizer: Quantizer | Starting, stats: Stats | None, check: Check | None,
               transform: Transform | None = None) -> tuple:  # fmt: skip
    """One item for the writer: (step, entries by key, the device-to-host copy's event or None, found). For a
    quantized weight, `tensor` is its stored tensors (`read_with`), which become its 16-bit tensor here, on
    the quantizing device; a merge's `transform` then applies to the 16-bit tensor."""
    name, stored_quantized = step.source.name, isinstance(step.source, QuantizedWeight)
    changed = transform is not None and transform.applies(step)
    if not step.quantize and not step.decision.dtype and not stored_quantized and not changed:
        return (step, {name: tensor}, None, found)
    quantizer = ready(quantizer)
    if loaded is not None:
        torch.cuda.current_stream(quantizer.device).wait_event(loaded)
    if stored_quantized:  # on the CPU, its pieces on the CPU kernel's threads
        each = _parallel.run if quantizer.device.type == "cpu" else None
        with trace.busy("dequantize"):
            tensor = dequantize(step.source, *tensor, each=each)
    if step.decision.dtype:  # the dtype transformers loads it in, as it casts it (torch's rounding)
        with trace.busy("cast"):
            tensor = tensor.to(SAFETENSORS_DTYPES[step.decision.dtype])
    if changed:
        tensor = transform(step, tensor)  # type: ignore[misc]
    if step.quantize:
        x = tensor.t() if step.decision.transpose else tensor
        with trace.busy("quantize"):
            entries = quantizer(x, name)
        if stats is not None:
            with trace.busy("stats"):
                stats.inspect(step, x, entries)
        entries = {entry_key(name, k): v for k, v in entries.items()}
    else:
        if check is not None:
            with trace.busy("check-kept"):
                found = check(name, tensor)
        entries = {name: tensor}
    copied = None
    if quantizer.device.type == "cuda":
        # Into pinned memory, asynchronously: this thread goes on to the next tensor while the copy runs, and the
        # writer waits for `copied`. Torch's caching host allocator reuses these buffers (it holds each until the
        # copy that used it has finished); the queue bounds how many are in use.
        with trace.busy("device-to-host"):
            host = {}
            for k, v in entries.items():
                # the quant state is made on the host; the code tables every tensor shares were copied once
                host[k] = v if v.device.type == "cpu" else quantizer.table_on_host(v)
                if host[k] is None:
                    host[k] = torch.empty(v.shape, dtype=v.dtype, pin_memory=True)
                    host[k].copy_(v, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(torch.cuda.current_stream(quantizer.device))
            entries = host
    return (step, entries, copied, found)


class Stop(Exception):
    """Another stage failed; this one stops quietly and the first error is raised."""


END = object()  # the last item a stage passes on


class Stage:
    """A bounded queue between two of the pipeline's threads that gives up as soon as any stage has failed."""

    def __init__(self, failed: threading.Event, name: str, size: int = IN_FLIGHT) -> None:
        self._put_label, self._get_label = f"{name}-put-wait", f"{name}-get-wait"
        self._q: queue.Queue = queue.Queue(maxsize=size)
        self._failed = failed

    def put(self, item: object) -> None:
        with trace.busy(self._put_label):
            while True:
                if self._failed.is_set():
                    raise Stop
                try:
                    self._q.put(item, timeout=0.1)
                    return
                except queue.Full:
                    continue

    def get(self) -> object:
        with trace.busy(self._get_label):
            while True:
                if self._failed.is_set():
                    raise Stop
                try:
                    return self._q.get(timeout=0.1)
                except queue.Empty:
                    continue


class GpuLoader:
    """Copies a tensor from its file to the GPU through two pinned buffers, on a side stream."""

    def __init__(self, source: TensorReader, device: torch.device) -> None:
        self.source, self.device = source, device
        self.stream = torch.cuda.Stream(device)
        self.buffers = [torch.empty(CHUNK_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        self.events = [torch.cuda.Event() for _ in range(2)]
        for ev in self.events:
            ev.record(self.stream)
        self.pool = ThreadPoolExecutor(max_workers=READ_THREADS, thread_name_prefix="prequant-read")

    def close(self) -> None:
        self.pool.shutdown(wait=True)

    def _fill(self, ref: TensorRef, start: int, buf: memoryview) -> None:
        """Bytes [start, start+len(buf)) of the tensor into buf, in READ_THREADS parts read at once."""
        part = -(-len(buf) // READ_THREADS // 4096) * 4096
        spans = [(a, min(len(buf), a + part)) for a in range(0, len(buf), part)]
        for f in [self.pool.submit(self.source.read_into, ref, start + a, buf[a:b]) for a, b in spans]:
            f.result()

    def load(self, ref: TensorRef) -> tuple[torch.Tensor, torch.cuda.Event]:
        if ref.offset == BIN_OFFSET:
            return self._load_bin(ref)
        out = torch.empty(ref.nbytes, dtype=torch.uint8, device=self.device)
        # `out` may reuse memory the default stream was still reading: order the copies after that work.
        self.stream.wait_stream(torch.cuda.default_stream(self.device))
        with torch.cuda.stream(self.stream):
            for i, start in enumerate(range(0, ref.nbytes, CHUNK_BYTES)):
                # No race though every one-chunk tensor takes buffer 0: a copy out records its event; a refill waits.
                buf, ev = self.buffers[i % 2], self.events[i % 2]
                with trace.busy("host-to-device-wait"):
                    ev.synchronize()  # the previous copy out of this buffer has finished
                n = min(CHUNK_BYTES, ref.nbytes - start)
                with trace.busy("read"):
                    self._fill(ref, start, memoryview(buf.numpy())[:n])
                out[start : start + n].copy_(buf[:n], non_blocking=True)
                ev.record(self.stream)
            done = torch.cuda.Event()
            done.record(self.stream)
        return out.view(SAFETENSORS_DTYPES[ref.dtype]).view(ref.shape), done

    def _load_bin(self, ref: TensorRef) -> tuple[torch.Tensor, torch.cuda.Event]:
        """A .bin shard's tensor has no byte range in its file: copy torch's memory-mapped tensor as it is."""
        src = self.source.view(ref)
        out = torch.empty(src.shape, dtype=src.dtype, device=self.device)
        self.stream.wait_stream(torch.cuda.default_stream(self.device))
        with torch.cuda.stream(self.stream):
            with trace.busy("read"):
                out.copy_(src)  # pageable: synchronous, straight from the mapped pages
            done = torch.cuda.Event()
            done.record(self.stream)
        return out, done


@dataclass(frozen=True)
class FileSlice:
    """Bytes of an open source file: a tensor kept as it is, copied file to file by the kernel."""

    fd: int
    offset: int
    nbytes: int


class ShardSet:
    """The open shard writers, journaling finished steps and shards (writer thread only)."""

    def __init__(
        self, plan: Plan, staging: Path, journal: Journal | None, on_shard: Callable[[str, BinaryIO], None],
        on_follow: Callable[[str, FollowHash], None] | None = None,
    ) -> None:
        self.plan, self.staging, self.journal, self.on_shard = plan, staging, journal, on_shard
        self.on_follow = on_follow  # a new shard whose hash can follow its writes (`follow_hash`)
        self.open: dict[str, ShardWriter] = {}
        self.sizes: dict[str, int] = {}
        self.steps_of: dict[str, list[Step]] = {}
        for step in plan.steps:
            self.steps_of.setdefault(step.shard, []).append(step)
        done = journal.done if journal else None
        # A shard's finished steps count only while its file (final or partial) is still there.
        self.finished = {s for s in (done.shards if done else ()) if (staging / s).exists()}
        self.done_steps = {
            step.source.name
            for step in plan.steps
            if done
            and step.source.name in done.steps
            and (step.shard in self.finished or (staging / f"{step.shard}.partial").exists())
        }

    def is_done(self, step: Step) -> bool:
        return step.shard in self.finished or step.source.name in self.done_steps

    def finish_resumed(self) -> None:
        """Finalize shards whose every step was done before an interruption (killed while finalizing)."""
        for shard, steps in self.steps_of.items():
            if shard in self.finished:
                self.sizes[shard] = self._data_bytes(shard)
                self.on_shard(shard, open(self.staging / shard, "rb", buffering=0))  # noqa: SIM115 - callee closes
            elif all(s.source.name in self.done_steps for s in steps):
                self._finalize(self._writer(shard))

    def write(self, step: Step, entries: dict[str, torch.Tensor], found: tuple[int, int] | None = None) -> None:
        """Write a step's entries; `found`: its NaN and Inf counts (a kept tensor's), journaled with it."""
        writer = self._writer(step.shard)
        for key, data in entries.items():
            if isinstance(data, FileSlice):
                writer.copy_range(key, data.fd, data.offset, data.nbytes)
            else:
                writer.write(key, data)
            failpoints.hit("tensor-written")
        if self.journal is not None:
            blobs = {o.key: writer.blob(o.key) for o in step.outputs if o.shape is None}
            self.journal.step_done(step.source.name, blobs, found)
            failpoints.hit("step-journaled")
        if writer.done:
            self._finalize(writer)

    def _writer(self, shard: str) -> ShardWriter:
        if shard not in self.open:
            steps = self.steps_of[shard]
            resumed = [s for s in steps if s.source.name in self.done_steps]
            writer = ShardWriter(self.staging / shard, [o for s in steps for o in s.outputs], resume=bool(resumed))
            blobs = self.journal.done.steps if self.journal else {}
            for step in resumed:
                for o in step.outputs:
                    writer.restore(o.key, blobs[step.source.name].get(o.key))
            if self.on_follow is not None and (follow := writer.follow()) is not None:
                self.on_follow(shard, follow)
            self.open[shard] = writer
        return self.open[shard]

    def _finalize(self, writer: ShardWriter) -> None:
        shard = writer.path.name
        writer.finalize(on_sealed=lambda file: self.on_shard(shard, file))
        self.sizes[shard] = writer.data_bytes
        del self.open[shard]
        if self.journal is not None:
            self.journal.shard_done(shard)
            failpoints.hit("shard-journaled")

    def _data_bytes(self, shard: str) -> int:
        with open(self.staging / shard, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
        return (self.staging / shard).stat().st_size - 8 - header_len

    def abort(self) -> None:
        for w in self.open.values():
            w.abort()
