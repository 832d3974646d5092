"""The output shard format's streaming write: a safetensors shard whose layout is fixed from the plan, its
tensors landing in place as they come, in any order.

Where everything of a shard goes is fixed before any data (`ShardLayout`, also what the plan predicts sizes from).
Data is ordered by element size, then name, as safetensors' own writer orders it, which keeps every tensor
aligned. The quant-state JSON blobs (their length is known only once quantized: the text holds a float) go at
the end of the data section and are written last, then the header; the header gets the room the longest
conceivable blobs would need, padded with spaces as the safetensors format allows, so its size, and every data
offset, is known from the plan alone.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import BinaryIO, Protocol

import torch

from ..checkpoint.dtypes import itemsize
from ..errors import PrequantError
from ..util import failpoints, gcpause, trace
from ..util.fsio import FULL, disk_full, write_error
from .follow_hash import FollowHash

_PLACEHOLDER_LEN = 9_999_999  # longer than any quant-state JSON: makes the reserved header big enough
# Writeback is started once this much has been written since the last start, over the whole file (only its dirty
# pages are written): one system call per step of this size, not one per tensor (a MoE layer has hundreds).
WRITEBACK_BYTES = 32 * 1024 * 1024


class Entry(Protocol):
    """One tensor of a shard (the plan's OutTensor): `shape` None for a quant-state JSON."""

    key: str
    dtype: str
    shape: tuple[int, ...] | None

    @property
    def nbytes(self) -> int: ...


class ShardLayout:
    """The offsets of a shard's fixed-size tensors and the size of its header (8-byte length + reserved JSON)."""

    def __init__(self, entries: Iterable[Entry], metadata: dict[str, str] | None = None) -> None:
        with gcpause.paused():  # a header dict per tensor: 280k of them in one shard of a large MoE model
            self._lay_out(list(entries), metadata)

    def _lay_out(self, entries: list[Entry], metadata: dict[str, str] | None) -> None:
        self.metadata = metadata or {"format": "pt"}
        self.fixed = sorted((e for e in entries if e.shape is not None), key=lambda e: (-itemsize(e.dtype), e.key))
        self.variable = sorted((e for e in entries if e.shape is None), key=lambda e: e.key)
        self.offsets: dict[str, tuple[int, int]] = {}
        pos = 0
        for e in self.fixed:
            self.offsets[e.key] = (pos, pos + e.nbytes)
            pos += e.nbytes
        self.fixed_end = pos
        # The metadata and the fixed-size tensors' entries, encoded once (the JSON object without its closing
        # brace): every header of the shard (the longest conceivable, the one a following hash starts from, the
        # sealed one) starts with them.
        head: dict[str, object] = {"__metadata__": self.metadata}
        for e in self.fixed:
            head[e.key] = {"dtype": e.dtype, "shape": list(e.shape or ()), "data_offsets": list(self.offsets[e.key])}
        self._head = json.dumps(head, separators=(",", ":")).encode()[:-1]
        longest = self.header({e.key: _PLACEHOLDER_LEN for e in self.variable})
        self.reserved = _round8(len(longest))
        self.data_start = 8 + self.reserved  # also the bytes a shard spends before its data

    def header(self, variable_sizes: dict[str, int]) -> bytes:
        """The header JSON once the variable-size tensors' sizes are known (unpadded): the fixed part, then the
        variable-size tensors' entries after it, as one JSON object."""
        tail: dict[str, object] = {}
        pos = self.fixed_end
        for e in self.variable:
            size = variable_sizes[e.key]
            tail[e.key] = {"dtype": e.dtype, "shape": [size], "data_offsets": [pos, pos + size]}
            pos += size
        if not tail:
            return self._head + b"}"
        return self._head + b"," + json.dumps(tail, separators=(",", ":")).encode()[1:]


def _round8(n: int) -> int:
    return (n + 7) // 8 * 8


class ShardWriter:
    """Writes one output shard; `write` may be called from any thread, in any order."""

    def __init__(
        self, path: Path, entries: list[Entry], metadata: dict[str, str] | None = None, *, resume: bool = False
    ) -> None:
        self.path = path
        self.partial = path.with_name(path.name + ".partial")
        self.layout = ShardLayout(entries, metadata)
        self._blobs: dict[str, bytes] = {}
        self._pending = {e.key for e in entries}
        self._lock = threading.Lock()
        self._resumed = resume
        self._follow: FollowHash | None = None
        self._runs: dict[int, int] = {}  # data written and not yet contiguous: start -> end (data offsets)
        self._contiguous = 0  # data bytes written, contiguous from the first
        self._unwritten = 0  # bytes written since writeback was last started
        # Resuming keeps the bytes already written; the layout is the same, since the plan is.
        self._fd = _open_for_write(self.partial, truncate=not (resume and self.partial.exists()))
        try:
            _preallocate(self._fd, self.layout.data_start + self.layout.fixed_end, self.partial)
        except BaseException:
            os.close(self._fd)
            raise

    def follow(self) -> FollowHash | None:
        """For a new shard whose header is known now (no quant-state JSON): a hash that follows the writes
        (`follow_hash`); else None."""
        if self.layout.variable or self._resumed or self._follow is not None:
            return None
        self._follow = FollowHash(self.partial, self._sealed_header({}), self.layout.data_start + self.layout.fixed_end)
        return self._follow

    def copy_range(self, key: str, src_fd: int, src_offset: int, nbytes: int) -> None:
        """Store a tensor straight from another file (a tensor kept as it is): the kernel copies the bytes,
        so they never pass through this process' memory."""
        begin, end = self.layout.offsets[key]
        if nbytes != end - begin:
            raise PrequantError(f"internal: {key} has {nbytes} bytes, the plan says {end - begin}")
        _copy_all(src_fd, src_offset, self._fd, self.layout.data_start + begin, nbytes, self.partial,
                  lambda lo, hi: self._written(begin + lo, begin + hi))  # fmt: skip
        self._writeback(nbytes)
        with self._lock:
            self._pending.discard(key)

    def restore(self, key: str, blob: bytes | None = None) -> None:
        """Mark a tensor written by an interrupted run (its bytes are already in the .partial file)."""
        if blob is not None:
            self._blobs[key] = blob
        with self._lock:
            self._pending.discard(key)

    def blob(self, key: str) -> bytes | None:
        """The bytes of a variable-size tensor (quant-state JSON), which the resume journal keeps."""
        return self._blobs.get(key)

    @property
    def done(self) -> bool:
        return not self._pending

    def write(self, key: str, data: torch.Tensor) -> None:
        """Store one tensor's bytes (a CPU tensor; a memory-mapped view is written without a copy)."""
        raw = data.detach().contiguous().view(-1).view(torch.uint8)
        if key in self.layout.offsets:
            begin, end = self.layout.offsets[key]
            if raw.numel() != end - begin:
                raise PrequantError(f"internal: {key} has {raw.numel()} bytes, the plan says {end - begin}")
            _pwrite_all(self._fd, memoryview(raw.numpy()), self.layout.data_start + begin, self.partial)
            self._written(begin, end)
            self._writeback(end - begin)
        else:
            self._blobs[key] = raw.numpy().tobytes()
        with self._lock:
            self._pending.discard(key)

    def _writeback(self, nbytes: int) -> None:
        """`nbytes` more are in the file: start their writeback once WRITEBACK_BYTES have gathered."""
        with self._lock:
            self._unwritten += nbytes
            if self._unwritten < WRITEBACK_BYTES:
                return
            self._unwritten = 0
        _start_writeback(self._fd)

    def _written(self, begin: int, end: int) -> None:
        """Data [begin, end) is in the file: tell the following hash how far the data is written without a gap."""
        if self._follow is None:
            return
        with self._lock:
            self._runs[begin] = end
            while self._contiguous in self._runs:
                self._contiguous = max(self._contiguous, self._runs.pop(self._contiguous))
            upto = self.layout.data_start + self._contiguous
        self._follow.advance(upto)

    def _sealed_header(self, sizes: dict[str, int]) -> bytes:
        """The file's first bytes once sealed: the header's length, then the header padded to its reserved room."""
        header = self.layout.header(sizes)
        padded = header + b" " * (self.layout.reserved - len(header))
        return len(padded).to_bytes(8, "little") + padded

    def finalize(self, on_sealed: Callable[[BinaryIO], None] | None = None) -> Path:
        """Write the quant-state blobs and the header, flush, and rename into place.

        `on_sealed` receives the finished file, open for reading (the callee closes it), as soon as its last
        byte is written and before the flush: hashing it need not wait for the disk."""
        if self._pending:
            raise PrequantError(f"internal: {self.path.name} finalized with {len(self._pending)} tensors missing")
        pos = self.layout.data_start + self.layout.fixed_end
        # The quant-state blobs go past the room reserved at the start: reserve theirs too before writing, so
        # that no write extends the file. A write past the end is where XFS adds speculative preallocation (as
        # much again as the file, up to 8 GiB), held until the file is closed, after the hashing and the fsync.
        tail = sum(len(self._blobs[e.key]) for e in self.layout.variable)
        if tail:
            _preallocate(self._fd, pos + tail, self.partial, start=pos)
        for e in self.layout.variable:
            _pwrite_all(self._fd, memoryview(self._blobs[e.key]), pos, self.partial)
            pos += len(self._blobs[e.key])
        failpoints.hit("shard-finalize")
        sealed = self._sealed_header({k: len(v) for k, v in self._blobs.items()})
        if self._follow is not None and sealed != self._follow.prefix:
            raise PrequantError(f"internal: {self.path.name}'s header changed after its hash began")
        _pwrite_all(self._fd, memoryview(sealed), 0, self.partial)
        self.data_bytes = pos - self.layout.data_start
        try:
            os.ftruncate(self._fd, pos)
            if on_sealed is not None:
                on_sealed(open(self.partial, "rb", buffering=0))  # noqa: SIM115 - the callee closes it
            with trace.busy("fsync"):
                os.fsync(self._fd)  # a full disk or quota can surface only here (delayed allocation, NFS)
            fd, self._fd = self._fd, -1  # closed even if close() reports an error: abort() must not close it again
            os.close(fd)
            os.replace(self.partial, self.path)
        except OSError as e:
            raise write_error(self.partial, e) from e
        trace.mark(f"shard-written:{self.path.name}")
        return self.path

    def abort(self) -> None:
        """Close without publishing (the .partial file stays for inspection or is cleaned by the caller)."""
        if self._follow is not None:
            self._follow.cancel()
        fd, self._fd = self._fd, -1
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass


def _load_sync_file_range():
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):  # not Linux/glibc: the final fsync does all the work
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_SYNC_FILE_RANGE = _load_sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2


def _start_writeback(fd: int) -> None:
    """Start writing the file's dirty pages to disk now, without waiting. Otherwise the kernel holds them dirty (up
    to a tenth of RAM) and the shard's fsync then writes gigabytes at once while the pipeline stands still.
    Advisory: errors are left to that fsync, which still runs and is what makes the shard durable."""
    if _SYNC_FILE_RANGE is not None:
        with trace.busy("writeback-start"):
            _SYNC_FILE_RANGE(fd, 0, 0, _SYNC_FILE_RANGE_WRITE)  # offset 0, length 0: the whole file


def _open_for_write(path: Path, truncate: bool = True) -> int:
    try:
        return os.open(path, os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if truncate else 0), 0o644)
    except PermissionError as e:
        raise PrequantError(f"{path.parent}: permission denied; choose a writable OUTPUT_DIR") from e


def _preallocate(fd: int, size: int, path: Path, start: int = 0) -> None:
    """Reserve the shard's space (bytes [start, size)) now, so a full disk fails at the start of the shard, not
    hours later."""
    try:
        os.posix_fallocate(fd, start, size - start)
    except OSError as e:
        if e.errno in FULL:
            raise disk_full(path, size - start) from e
        try:
            os.ftruncate(fd, size)  # filesystems without fallocate: a sparse file, space taken as written
        except OSError as e2:
            if e2.errno in FULL:
                raise disk_full(path, size - start) from e2
            raise PrequantError(f"{path}: cannot size the file ({e2.strerror}); choose another OUTPUT_DIR") from e2


def _pwrite_all(fd: int, data: memoryview, offset: int, path: Path) -> None:
    done = 0
    try:
        while done < len(data):
            done += os.pwrite(fd, data[done:], offset + done)
    except OSError as e:
        if e.errno in FULL:
            raise disk_full(path, len(data) - done) from e
        raise PrequantError(f"{path}: write failed ({e.strerror})") from e


COPY_PIECE = 64 * 1024 * 1024  # bytes per copy call, at most: a hash following the writes follows a large copy


def _copy_all(src: int, src_offset: int, dst: int, dst_offset: int, nbytes: int, path: Path,
              copied: Callable[[int, int], None] = lambda lo, hi: None) -> None:  # fmt: skip
    """Copy nbytes from src to dst by the kernel (else through memory); `copied(lo, hi)`: bytes [lo, hi) of the
    range are in dst."""
    done = 0
    try:
        while done < nbytes:
            piece = min(COPY_PIECE, nbytes - done)
            try:
                n = os.copy_file_range(src, dst, piece, src_offset + done, dst_offset + done)
            except OSError as e:
                if e.errno not in (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
                    raise
                n = _copy_chunk(src, src_offset + done, dst, dst_offset + done, piece, path)
            if n == 0:
                raise PrequantError(f"{path}: the source ended early while copying; was it truncated meanwhile?")
            copied(done, done + n)
            done += n
    except OSError as e:
        if e.errno in FULL:
            raise disk_full(path, nbytes - done) from e
        raise PrequantError(f"{path}: write failed ({e.strerror})") from e


def _copy_chunk(src: int, src_offset: int, dst: int, dst_offset: int, nbytes: int, path: Path) -> int:
    """Fallback where copy_file_range cannot work (e.g. across some filesystems): 8 MiB through memory."""
    data = os.pread(src, min(nbytes, 8 * 1024 * 1024), src_offset)
    if data:
        _pwrite_all(dst, memoryview(data), dst_offset, path)
    return len(data)
