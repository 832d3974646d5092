"""Stream tensors out of checkpoint files without ever loading a shard.

safetensors headers are parsed here (not by the safetensors library) so that every defect of a file
(short file, header longer than the file, bad JSON, offsets out of range or overlapping) becomes one
PrequantError naming the file and tensor, checked before any work starts. Data is then reached through
a private memory map (zero-copy, file-backed: it never counts as the process' anonymous memory) or read
in chunks with pread into caller-owned buffers.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from .dtypes import SAFETENSORS_DTYPES, itemsize
from .errors import PrequantError

# A safetensors header is JSON; real ones are well under 100 MB even for thousands of tensors.
MAX_HEADER_BYTES = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorRef:
    """Where one source tensor lives: file, byte range, dtype and shape."""

    name: str
    dtype: str  # safetensors code, e.g. "BF16"
    shape: tuple[int, ...]
    file: Path
    offset: int  # absolute offset of the first byte in `file`
    nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def read_header(path: Path) -> tuple[list[TensorRef], dict[str, str]]:
    """Parse and validate one safetensors file's header; return its tensors and metadata."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise PrequantError(f"{path}: file is {size} bytes, too short to be safetensors; re-download it")
            (n,) = struct.unpack("<Q", prefix)
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise PrequantError(
                    f"{path}: header length {n} exceeds the file size {size}; the file is truncated or not "
                    "safetensors, re-download it"
                )
            raw = f.read(n)
    except PermissionError as e:
        raise PrequantError(f"{path}: permission denied ({e.strerror}); make it readable") from e
    except IsADirectoryError as e:
        raise PrequantError(f"{path}: is a directory, expected a safetensors file") from e
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PrequantError(f"{path}: header is not valid JSON ({e}); the file is corrupt, re-download it") from e
    if not isinstance(header, dict):
        raise PrequantError(f"{path}: header is not a JSON object; the file is corrupt, re-download it")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise PrequantError(f"{path}: __metadata__ is not a JSON object; the file is corrupt")
    data_start = 8 + n
    refs = [_parse_entry(path, name, entry, data_start, size - data_start) for name, entry in header.items()]
    _check_no_overlap(path, refs, data_start)
    return refs, {str(k): str(v) for k, v in metadata.items()}


def _parse_entry(path: Path, name: str, entry: object, data_start: int, data_size: int) -> TensorRef:
    where = f"{path}: tensor {name!r}"
    if not isinstance(entry, dict):
        raise PrequantError(f"{where}: header entry is not an object; the file is corrupt")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in SAFETENSORS_DTYPES:
        raise PrequantError(
            f"{where}: dtype {dtype!r} is not supported; convert the checkpoint to bf16, fp16 or fp32 first"
        )
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise PrequantError(f"{where}: shape {shape!r} is not a list of non-negative integers; the file is corrupt")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
    ):
        raise PrequantError(f"{where}: data_offsets {offsets!r} is not a pair of integers; the file is corrupt")
    begin, end = offsets
    expected = math.prod(shape) * itemsize(dtype)
    if begin < 0 or end < begin or end - begin != expected:
        raise PrequantError(
            f"{where}: data_offsets {offsets} do not match {dtype}{shape} ({expected} bytes); the file is corrupt"
        )
    if end > data_size:
        raise PrequantError(
            f"{where}: data ends at byte {data_start + end} but the file has {data_start + data_size}; "
            "the file is truncated, re-download it"
        )
    return TensorRef(name, dtype, tuple(shape), path, data_start + begin, end - begin)


def _check_no_overlap(path: Path, refs: list[TensorRef], data_start: int) -> None:
    previous: TensorRef | None = None
    for ref in sorted(refs, key=lambda r: (r.offset, r.nbytes)):
        if previous is not None and ref.nbytes and ref.offset < previous.offset + previous.nbytes:
            raise PrequantError(
                f"{path}: tensors {previous.name!r} and {ref.name!r} overlap in the file; the file is corrupt"
            )
        if ref.nbytes:
            previous = ref


def scan(files: Iterable[Path]) -> list[TensorRef]:
    """Read every file's header; refuse a tensor present in two files. Order: file, then offset."""
    seen: dict[str, TensorRef] = {}
    ordered: list[TensorRef] = []
    for path in files:
        refs, _ = read_header(path)
        for ref in sorted(refs, key=lambda r: r.offset):
            if ref.name in seen:
                raise PrequantError(
                    f"tensor {ref.name!r} is in both {seen[ref.name].file.name} and {path.name}; "
                    "remove the stale shard from the source directory"
                )
            seen[ref.name] = ref
            ordered.append(ref)
    return ordered


def check_index(index_path: Path, tensors: list[TensorRef]) -> None:
    """Check a `*.index.json` weight_map against the tensors actually found in the shards."""
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise PrequantError(f"{index_path}: not a valid index (needs a 'weight_map' object): {e}") from e
    found = {t.name: t.file.name for t in tensors}
    for name, filename in weight_map.items():
        if name not in found:
            raise PrequantError(
                f"{index_path.name}: tensor {name!r} is listed in {filename} but no shard holds it; "
                "the download is incomplete, re-download the missing shard"
            )
        if Path(filename).name != found[name]:
            raise PrequantError(
                f"{index_path.name}: tensor {name!r} is listed in {filename} but found in {found[name]}; "
                "the index and the shards disagree, re-download the checkpoint"
            )


class TensorSource:
    """Gives zero-copy views of source tensors, and chunked reads into caller buffers.

    One private mapping per file, opened on first use and closed with the source. Views are
    file-backed pages: the kernel may drop and re-read them, so they never pin anonymous memory.
    """

    def __init__(self) -> None:
        self._maps: dict[Path, mmap.mmap] = {}
        self._fds: dict[Path, int] = {}

    def fd(self, path: Path) -> int:
        if path not in self._fds:
            self._fds[path] = os.open(path, os.O_RDONLY)
        return self._fds[path]

    def view(self, ref: TensorRef) -> torch.Tensor:
        """The tensor as a CPU view over the memory-mapped file (no copy)."""
        dtype = SAFETENSORS_DTYPES[ref.dtype]
        if ref.nbytes == 0:
            return torch.empty(ref.shape, dtype=dtype)
        if ref.file not in self._maps:
            # ACCESS_COPY (MAP_PRIVATE) gives a writable buffer for torch.frombuffer without ever
            # writing back; pages stay shared with the page cache as long as nobody writes them.
            self._maps[ref.file] = mmap.mmap(self.fd(ref.file), 0, access=mmap.ACCESS_COPY)
        flat = torch.frombuffer(self._maps[ref.file], dtype=torch.uint8, count=ref.nbytes, offset=ref.offset)
        return flat.view(dtype).view(ref.shape)

    def read_into(self, ref: TensorRef, start: int, out: memoryview) -> None:
        """Read bytes [start, start+len(out)) of the tensor into `out` (pread: no shared file position)."""
        fd, pos, done = self.fd(ref.file), ref.offset + start, 0
        while done < len(out):
            n = os.preadv(fd, [out[done:]], pos + done)
            if n == 0:
                raise PrequantError(f"{ref.file}: unexpected end of file reading {ref.name!r}; the file is truncated")
            done += n

    def advise_willneed(self, ref: TensorRef) -> None:
        """Ask the kernel to start reading a tensor's pages now (readahead for the next tensor)."""
        try:
            os.posix_fadvise(self.fd(ref.file), ref.offset, ref.nbytes, os.POSIX_FADV_WILLNEED)
        except (AttributeError, OSError):
            pass  # advisory only

    def close(self) -> None:
        for m in self._maps.values():
            try:
                m.close()
            except BufferError:
                pass  # a view is still alive somewhere; the map is freed with it
        for fd in self._fds.values():
            os.close(fd)
        self._maps.clear()
        self._fds.clear()

    def __enter__(self) -> TensorSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
