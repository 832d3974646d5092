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
import threading
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
    """Parse and validate one safetensors file's header; return its tensors and metadata.

    Any defect, whatever the bytes, is a PrequantError naming the file (and the tensor, when one is at fault)."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(header_length(path, f.read(8), size))
    except PermissionError as e:
        raise PrequantError(f"{path}: permission denied; make it readable") from e
    except IsADirectoryError as e:
        raise PrequantError(f"{path}: is a directory, expected a safetensors file; remove or rename it") from e
    except OSError as e:  # missing (removed meanwhile), I/O error, ...: whatever it is, name the file
        raise PrequantError(f"{path}: cannot read it ({e.strerror or e}); check the file and re-download it") from e
    return parse_header(path, raw, size)


def header_length(path: Path, prefix: bytes, size: int) -> int:
    """The header length a safetensors file's first 8 bytes (`prefix`) announce, checked against the file's
    `size`; works on bytes read locally or fetched by a range request."""
    if len(prefix) < 8:
        raise PrequantError(f"{path}: file is {size} bytes, too short to be safetensors; re-download it")
    (n,) = struct.unpack("<Q", prefix)
    if 8 + n > size:
        raise PrequantError(
            f"{path}: header length {n} exceeds the file size {size}; the file is truncated or not "
            "safetensors, re-download it"
        )
    if n > MAX_HEADER_BYTES:
        raise PrequantError(
            f"{path}: header length {n} is over {MAX_HEADER_BYTES} bytes, more than any real checkpoint; "
            "the file is corrupt or not safetensors, re-download it"
        )
    return n


def parse_header(path: Path, raw: bytes, size: int) -> tuple[list[TensorRef], dict[str, str]]:
    """Tensors and metadata from a safetensors header given as bytes (`raw`: the JSON after the 8-byte
    length; `size`: the whole file's), e.g. fetched by a range request before the file is downloaded."""
    try:
        header = json.loads(raw)
    # ValueError covers bad JSON, bad UTF-8 and integers too long to parse; RecursionError, deeply nested junk.
    except (ValueError, RecursionError) as e:
        raise PrequantError(
            f"{path}: header is not valid JSON ({_reason(e)}); the file is corrupt, re-download it"
        ) from e
    if not isinstance(header, dict):
        raise PrequantError(f"{path}: header is not a JSON object; the file is corrupt, re-download it")
    metadata = header.pop("__metadata__", None)
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict):
        raise PrequantError(f"{path}: __metadata__ is not a JSON object; the file is corrupt, re-download it")
    data_start = 8 + len(raw)
    refs = [_parse_entry(path, name, entry, data_start, size - data_start) for name, entry in header.items()]
    _check_no_overlap(path, refs)
    return refs, {str(k): str(v) for k, v in metadata.items()}


# Dimensions must fit torch's int64 sizes, even for an empty tensor whose other dimensions are huge; the
# rank is bounded so that the product of a hostile shape stays cheap to compute and to print.
_MAX_DIM = 2**63 - 1
_MAX_RANK = 64


def _parse_entry(path: Path, name: str, entry: object, data_start: int, data_size: int) -> TensorRef:
    where = f"{path}: tensor {_name(name)}"
    corrupt = "the file is corrupt, re-download it"
    if not isinstance(entry, dict):
        raise PrequantError(f"{where}: header entry is not an object; {corrupt}")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in SAFETENSORS_DTYPES:
        raise PrequantError(
            f"{where}: dtype {_short(dtype)} is not supported; convert the checkpoint to bf16, fp16 or fp32 first"
        )
    if (
        not isinstance(shape, list)
        or len(shape) > _MAX_RANK
        or not all(_is_int(d) and 0 <= d <= _MAX_DIM for d in shape)
    ):
        raise PrequantError(
            f"{where}: shape {_short(shape)} is not a list of at most {_MAX_RANK} non-negative integers; {corrupt}"
        )
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_int(o) for o in offsets):
        raise PrequantError(f"{where}: data_offsets {_short(offsets)} is not a pair of integers; {corrupt}")
    begin, end = offsets
    expected = math.prod(shape) * itemsize(dtype)
    if begin < 0 or end < begin or end - begin != expected:
        raise PrequantError(
            f"{where}: data_offsets {_short(offsets)} do not match {dtype}{_short(shape)} ({_short(expected)} bytes); "
            f"{corrupt}"
        )
    if end > data_size:
        raise PrequantError(
            f"{where}: data_offsets {_short(offsets)} run past the end of the data ({data_size} bytes after the "
            "header); the file is truncated or corrupt, re-download it"
        )
    return TensorRef(name, dtype, tuple(shape), path, data_start + begin, end - begin)


def _name(name: str, limit: int = 200) -> str:
    """A tensor name for a message: repr'd (so it stays on one line) and bounded."""
    return repr(name if len(name) <= limit else name[: limit - 3] + "...")


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)  # JSON true/false arrive as bool, a subclass of int


def _short(value: object, limit: int = 80) -> str:
    """A header value for a message: one line, bounded (a corrupt header may hold megabytes of junk)."""
    try:
        text = json.dumps(value)
    except (ValueError, TypeError, RecursionError):
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _reason(e: BaseException, limit: int = 120) -> str:
    """An exception as a short one-line reason for a message."""
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _check_no_overlap(path: Path, refs: list[TensorRef]) -> None:
    previous: TensorRef | None = None
    for ref in sorted(refs, key=lambda r: (r.offset, r.nbytes)):
        if previous is not None and ref.nbytes and ref.offset < previous.offset + previous.nbytes:
            raise PrequantError(
                f"{path}: tensors {_name(previous.name)} and {_name(ref.name)} overlap in the file; the file is corrupt, "
                "re-download it"
            )
        if ref.nbytes:
            previous = ref


def scan(files: Iterable[Path]) -> list[TensorRef]:
    """Read every file's header; refuse a tensor present in two files. Order: file, then offset."""
    per_file = (
        _bin_refs(path) if path.suffix == ".bin" else sorted(read_header(path)[0], key=lambda r: r.offset)
        for path in files
    )
    return merge(per_file, "remove the stale shard from the source directory")


def merge(per_file: Iterable[list[TensorRef]], fix: str) -> list[TensorRef]:
    """Concatenate the files' tensor lists in order; a name in two files is an error ending with `fix`."""
    seen: dict[str, TensorRef] = {}
    ordered: list[TensorRef] = []
    for refs in per_file:
        for ref in refs:
            if ref.name in seen:
                raise PrequantError(
                    f"tensor {_name(ref.name)} is in both {seen[ref.name].file.name} and {ref.file.name}; {fix}"
                )
            seen[ref.name] = ref
            ordered.append(ref)
    return ordered


def _bin_refs(path: Path) -> list[TensorRef]:
    """A PyTorch pickle shard's tensors, in the file's order. Their bytes have no fixed place we know of
    in the file (offset -1): TensorSource reaches them through the shard's memory-mapped state dict."""
    from . import binreader

    return [TensorRef(name, dtype, shape, path, BIN_OFFSET, nbytes) for name, dtype, shape, nbytes in
            binreader.describe(path, binreader.load(path))]


BIN_OFFSET = -1


def check_index(index_path: Path, tensors: list[TensorRef]) -> None:
    """Check a `*.index.json` weight_map against the tensors actually found in the shards."""
    from .source import read_weight_map

    weight_map = read_weight_map(index_path)
    found = {t.name: t.file.name for t in tensors}
    for name, filename in weight_map.items():
        if name not in found:
            raise PrequantError(
                f"{index_path.name}: tensor {_name(name)} is listed in {_name(filename)} but no shard holds it; "
                "the download is incomplete, re-download the missing shard"
            )
        if Path(filename).name != found[name]:
            raise PrequantError(
                f"{index_path.name}: tensor {_name(name)} is listed in {_name(filename)} but found in "
                f"{found[name]}; the index and the shards disagree, re-download the checkpoint"
            )


class TensorSource:
    """Gives zero-copy views of source tensors, and chunked reads into caller buffers.

    One private mapping per file, opened on first use and closed with the source. Views are
    file-backed pages: the kernel may drop and re-read them, so they never pin anonymous memory.
    """

    def __init__(self) -> None:
        self._maps: dict[Path, mmap.mmap] = {}
        self._fds: dict[Path, int] = {}
        self._bins: dict[Path, dict[str, torch.Tensor]] = {}  # .bin shards: memory-mapped state dicts

    def prepare(self, path: Path, stop: threading.Event | None = None) -> None:
        """Wait until `path` can be read. Local files always can; a streamed Hub source waits for the
        shard's download (and gives up when `stop` is set: another pipeline stage failed)."""

    def step_done(self, step: object) -> None:
        """A step's outputs are written. Local files need nothing; a Hub source may evict a finished shard."""

    def fd(self, path: Path) -> int:
        if path not in self._fds:
            self._fds[path] = os.open(path, os.O_RDONLY)
        return self._fds[path]

    def _bin_tensor(self, ref: TensorRef) -> torch.Tensor:
        if ref.file not in self._bins:
            from . import binreader

            self._bins[ref.file] = binreader.load(ref.file)
        return self._bins[ref.file][ref.name]

    def view(self, ref: TensorRef) -> torch.Tensor:
        """The tensor as a CPU view over the memory-mapped file (no copy)."""
        dtype = SAFETENSORS_DTYPES[ref.dtype]
        if ref.nbytes == 0:
            return torch.empty(ref.shape, dtype=dtype)
        if ref.offset == BIN_OFFSET:
            return self._bin_tensor(ref)
        fd = self.fd(ref.file)
        if ref.file not in self._maps:
            # ACCESS_COPY (MAP_PRIVATE) gives a writable buffer for torch.frombuffer without ever
            # writing back; pages stay shared with the page cache as long as nobody writes them.
            self._maps[ref.file] = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
        # Touching mapped pages past the end of a file raises SIGBUS, which kills the process without a word:
        # a file cut short since it was scanned gets an error naming it instead.
        size = os.fstat(fd).st_size
        if size < ref.offset + ref.nbytes:
            raise PrequantError(
                f"{ref.file}: now {size:,} bytes, too short for {ref.name!r} (which ends at byte "
                f"{ref.offset + ref.nbytes:,}); the file changed while prequant was reading it: restore it and rerun"
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
                raise PrequantError(f"{ref.file}: unexpected end of file reading {ref.name!r}; the file is truncated")
            done += n

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
        self._bins.clear()

    def __enter__(self) -> TensorSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
