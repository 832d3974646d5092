"""Read tensor data without ever loading a shard: zero-copy views and chunked reads of the tensors that
`scan_files` found in a checkpoint's files.

Data is reached through a private memory map (zero-copy, file-backed: it never counts as the process'
anonymous memory) or read in chunks with pread into caller-owned buffers.
"""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from ..errors import PrequantError
from . import binreader, quantized
from .dtypes import SAFETENSORS_DTYPES
from .safetensors import read_header
from .tensors import BIN_OFFSET, QuantizedWeight, TensorRef, merge


def scan_files(files: Iterable[Path]) -> list[TensorRef]:
    """Read every file's header; refuse a tensor present in two files. Order: file, then offset."""
    per_file = (
        bin_refs(path) if path.suffix == ".bin" else sorted(read_header(path)[0], key=lambda r: r.offset)
        for path in files
    )
    return merge(per_file, "remove the stale shard from the source directory")


def bin_refs(path: Path, state: dict[str, torch.Tensor] | None = None) -> list[TensorRef]:
    """A PyTorch pickle shard's tensors, in the file's order (`state`: its state dict, if already unpickled).
    Their bytes have no fixed place we know of in the file (BIN_OFFSET): TensorReader reaches them through the
    shard's memory-mapped state dict."""
    state = binreader.load(path) if state is None else state
    return [TensorRef(name, dtype, shape, path, BIN_OFFSET, nbytes) for name, dtype, shape, nbytes in
            binreader.describe(path, state)]


class TensorReader:
    """Gives zero-copy views of source tensors, and chunked reads into caller buffers.

    One private mapping per file, opened on first use and closed with the reader. Views are
    file-backed pages: the kernel may drop and re-read them, so they never pin anonymous memory.
    Safe to use from several threads at once (the GPU loader reads one tensor's parts in parallel).
    """

    def __init__(self) -> None:
        # Opening is check-then-open: without the lock, threads reading a shard's first tensor at once each
        # opened it and all but one descriptor leaked, holding a deleted Hub shard's disk space until exit.
        self._open_lock = threading.Lock()
        self._maps: dict[Path, mmap.mmap] = {}
        self._fds: dict[Path, int] = {}
        self._bins: dict[Path, dict[str, torch.Tensor]] = {}  # .bin shards: memory-mapped state dicts

    def prepare(self, path: Path, stop: threading.Event | None = None) -> None:
        """Wait until `path` can be read. Local files always can; a streamed Hub source waits for the
        shard's download (and gives up when `stop` is set: another pipeline stage failed)."""

    def tensor_done(self, ref: TensorRef) -> None:
        """A tensor's outputs are written. Local files need nothing; a Hub source may evict a finished shard."""

    def claim(self, names: Iterable[str]) -> None:
        """Shards an interrupted run of this job downloaded, to delete once converted. Local files: none."""

    def on_download(self, record: Callable[[str], None]) -> None:
        """Call `record(name)` for each shard this run downloads. Local files are never downloaded."""

    def fd(self, path: Path) -> int:
        """This reader's descriptor of `path` (opened once, whatever the threads asking)."""
        with self._open_lock:
            if path not in self._fds:
                self._fds[path] = os.open(path, os.O_RDONLY)
            return self._fds[path]

    def holds(self, path: Path) -> bool:
        """Whether this reader holds `path` open (it has read from it, and not released it)."""
        with self._open_lock:
            return path in self._fds

    def _bin_tensor(self, ref: TensorRef) -> torch.Tensor:
        if ref.file not in self._bins:
            self._bins[ref.file] = binreader.load(ref.file)
        return self._bins[ref.file][ref.name]

    def view(self, ref: TensorRef) -> torch.Tensor:
        """The tensor as a CPU view over the memory-mapped file (no copy); a quantized weight as the 16-bit tensor
        it dequantizes to (a copy: the conversion's pipeline reads its stored tensors instead, for its own device)."""
        if isinstance(ref, QuantizedWeight):
            quantized.check_stored(ref, self.view)
            return quantized.dequantize(ref, *(self.view(piece) for piece in quantized.read_with(ref)))
        dtype = SAFETENSORS_DTYPES[ref.dtype]
        if ref.nbytes == 0:
            return torch.empty(ref.shape, dtype=dtype)
        if ref.offset == BIN_OFFSET:
            return self._bin_tensor(ref)
        fd = self.fd(ref.file)
        with self._open_lock:
            if ref.file not in self._maps:
                # ACCESS_COPY (MAP_PRIVATE) gives a writable buffer for torch.frombuffer without ever
                # writing back; pages stay shared with the page cache as long as nobody writes them.
                self._maps[ref.file] = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
        # Touching mapped pages past the end of a file raises SIGBUS, which kills the process without a word:
        # a file cut short since it was scanned gets an error naming it instead.
        size = os.fstat(fd).st_size
        if size < ref.offset + ref.nbytes:
            raise PrequantError(
                f"now {size:,} bytes, too short for {ref.name!r} (which ends at byte {ref.offset + ref.nbytes:,}); "
                "the file changed while prequant was reading it: restore it and rerun",
                where=ref.file,
            )
        flat = torch.frombuffer(self._maps[ref.file], dtype=torch.uint8, count=ref.nbytes, offset=ref.offset)
        return flat.view(dtype).view(ref.shape)

    def read_into(self, ref: TensorRef, start: int, out: memoryview) -> None:
        """Read bytes [start, start+len(out)) of a safetensors tensor into `out` (pread: no shared file position).
        A .bin shard's tensors have no byte range: read them through `view`."""
        if ref.offset == BIN_OFFSET:
            raise PrequantError(f"internal: {ref.name} is in a .bin shard, which has no byte ranges; use view()")
        fd, pos, done = self.fd(ref.file), ref.offset + start, 0
        while done < len(out):
            n = os.preadv(fd, [out[done:]], pos + done)
            if n == 0:
                raise PrequantError(f"unexpected end of file reading {ref.name!r}; the file is truncated", where=ref.file)
            done += n

    def release(self, path: Path) -> None:
        """Drop this reader's handles on one file (so that deleting it frees its space)."""
        with self._open_lock:
            mapping = self._maps.pop(path, None)
            fd = self._fds.pop(path, None)
            self._bins.pop(path, None)
        if mapping is not None:
            try:
                mapping.close()
            except BufferError:
                pass  # a view is still alive (the pipeline's last one): unmapped when it goes
        if fd is not None:
            os.close(fd)

    def close(self) -> None:
        for path in list({*self._maps, *self._fds, *self._bins}):
            self.release(path)

    def __enter__(self) -> TensorReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
