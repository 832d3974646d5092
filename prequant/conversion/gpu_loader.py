"""A tensor from its file to the GPU: through two pinned buffers, on a side stream, read by a few threads at once.

Host memory stays at the two buffers whatever the tensor size; the next chunk is read while the previous one is
copied to the device.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import torch

from ..checkpoint.dtypes import SAFETENSORS_DTYPES
from ..checkpoint.reader import TensorReader
from ..checkpoint.tensors import BIN_OFFSET, TensorRef
from ..util import trace

CHUNK_BYTES = 64 * 1024 * 1024  # pinned staging buffer size for host-to-device copies
# Threads filling one staging buffer: a single thread copies from the page cache at ~3 GB/s, below what a
# read-ahead source delivers; the copies (preadv) run without the GIL.
READ_THREADS = 4


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
            for i, start in enumerate(_chunks(ref.nbytes)):
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


def _chunks(nbytes: int) -> Iterator[int]:
    return iter(range(0, nbytes, CHUNK_BYTES))
