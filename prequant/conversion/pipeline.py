"""The streaming engine: read tensor i+1, quantize tensor i, write tensor i-1, all at once.

Three stages joined by small bounded queues, so at most a few tensors are in flight whatever the
model size:

    reader thread  ->  main thread (quantize)  ->  writer thread
    page-in / H2D       CPU kernel or CUDA,        pwrite into the shard,
                        async device-to-host       finalize shard when complete

On a GPU the reader copies the file through two fixed pinned buffers into a device tensor on its own
CUDA stream, and results come back into pinned buffers that torch's caching host allocator reuses, so host
memory stays at those buffers and the few tensors in flight. While CUDA is still starting (`bnb.starting`), the
reader hands over memory-mapped views instead, which the CPU kernel quantizes to the same bytes. On the CPU the
reader hands over zero-copy memory-mapped views; `readahead` keeps the kernel reading the files ahead; the
quantizing thread hands whole tensors to worker processes, one per core (`quantizing`, `bnb.tensor_pool`), or, on
few cores, spreads each tensor's quantization and statistics over the kernels' thread pool
(`bnb.kernels._parallel`), so this
stage uses every core rather than one. Tensors kept as they are never enter this process's stages: a thread
of their own asks for their pages and checks their values on the mapped view (one reduction over the pages the
copy reads anyway) while the reader goes on, then the writer, once the check has passed, has the kernel copy
them file to file (copy_file_range). A tensor transformers loads in another dtype goes through the
quantizing device like a quantized one and is cast there.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO

import torch

from ..bnb.quantize import Quantizer
from ..bnb.starting import Starting
from ..checkpoint.reader import TensorReader
from ..checkpoint.tensors import BIN_OFFSET, TensorRef
from ..util import pagecache, trace
from .follow_hash import FollowHash
from .gpu_loader import GpuLoader
from .journal import Journal
from .plan import Plan, Step
from .quantizing import Stats, quantize_all
from .shardset import FileSlice, ShardSet
from .stages import END, Stage, Stop

# check(name, kept tensor) -> (NaN, Inf) counts when not all finite; raises to refuse it (`kept.KeptCheck`).
Check = Callable[[str, torch.Tensor], "tuple[int, int] | None"]


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
) -> dict[str, int]:
    """Convert every step of the plan into shards under `staging`; return each shard's tensor bytes.

    With a journal, finished work is recorded as it lands and work a previous run finished is skipped.
    `on_step` is called (from the writer thread) after each step's outputs are written, or at start for
    each step already done; `stats` measures each quantized tensor (on the quantizing device, where statistics
    are cheap, or on the worker process that quantized it: `quantizing`); `on_shard(name, file)` (writer thread) when a
    shard's bytes are all written, with the shard open for reading (the callee closes it), before its flush;
    `check(name, tensor)` on every kept tensor's values as written (its counts go into the journal);
    `on_follow(name, hash)` (writer thread) when a shard whose header is already known opens: `hash.run()` gives its
    sha256 as it is written (`follow_hash`), and `on_shard` then only closes that shard's file.

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

    loaders: list[GpuLoader] = []  # made when the first tensor goes to the GPU

    def read_all() -> None:
        try:
            read_steps()
        finally:
            for loader in loaders:
                loader.close()
        loaded.put(END)

    def to_device(ref: TensorRef) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """The tensor where the quantizer that takes it now works: the GPU, or a mapped view on the CPU (also
        while a CUDA quantizer is starting: `bnb.starting`)."""
        device = quantizer.now().device
        if device.type != "cuda":
            return source.view(ref), None
        if not loaders:
            loaders.append(GpuLoader(source, device))
        return loaders[0].load(ref)

    # Kept tensors are checked on a thread of their own, in order, and the writer waits for each one's result
    # before writing it: the reader goes on handing tensors to the quantizing stage meanwhile. A check reads
    # its tensor cold when the read-ahead has not reached it (on the CPU the read-ahead leads the writes by only
    # 2 GB, `readahead`). Done on the reader, a 1 GB embedding's check stopped the pipeline: on the GPU machine's
    # 16 GB --device cpu run the reader spent 8.6-8.7 s in it (0.65 s on cuda, whose read-ahead had read the
    # source) while the quantizing stage waited 6.1-6.7 s for the reader, with its pages asked for first or not
    # (`scripts/bench/convert.py --also-device cpu`, PREQUANT_TRACE, 2026-12-03).
    checks = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prequant-check") if check is not None else None

    def check_kept(ref: TensorRef) -> tuple[int, int] | None:
        """A kept tensor's check, its pages asked for first in large asynchronous requests: through the mapped
        view each page fault is a small read that waits behind everything queued before it."""
        assert check is not None
        with trace.busy("check-kept"):
            if ref.offset != BIN_OFFSET:
                pagecache.will_need(source.fd(ref.file), ref.offset, ref.nbytes)
            return check(ref.name, source.view(ref))

    def read_steps() -> None:
        # No advice for what the quantizing device takes (local files are read ahead by readahead.py, Hub shards
        # were just written, CPU workers ask for their own tensor); a kept tensor's is asked for before its check.
        for step in todo:
            source.prepare(step.source.file, failed)  # a Hub source: wait for the shard's download
            found = None
            if step.quantize or step.decision.dtype:  # through the quantizing device, to be quantized or cast
                data = to_device(step.source)
            else:
                if checks is not None:
                    found = checks.submit(check_kept, step.source)
                if step.source.offset != BIN_OFFSET:
                    data = (FileSlice(source.fd(step.source.file), step.source.offset, step.source.nbytes), None)
                else:  # a .bin shard's tensor: no known byte range, written from its memory-mapped view
                    data = (source.view(step.source), None)
            loaded.put((step, data, found))

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
        work = sum(s.source.nbytes for s in todo if s.quantize)
        guarded(lambda: quantize_all(loaded, quantized, quantizer, stats, check, work))()  # a failure sets `failed`
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
