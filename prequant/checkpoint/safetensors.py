"""safetensors headers, parsed and checked here (not by the safetensors library), so that every defect of a
file (short file, header longer than the file, bad JSON, offsets out of range or overlapping) becomes one
PrequantError naming the file and tensor, before any work starts."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

from ..errors import PrequantError
from .dtypes import SAFETENSORS_DTYPES, itemsize
from .tensors import TensorRef, quote, reason, short

# A safetensors header is JSON; real ones are well under 100 MB even for thousands of tensors.
MAX_HEADER_BYTES = 100 * 1024 * 1024
CORRUPT = "the file is corrupt, re-download it"


def read_header(path: Path) -> tuple[list[TensorRef], dict[str, str]]:
    """Parse and validate one safetensors file's header; return its tensors and metadata.

    Any defect, whatever the bytes, is a PrequantError naming the file (and the tensor, when one is at fault)."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(header_length(path, f.read(8), size))
    except PermissionError as e:
        raise PrequantError("permission denied; make it readable", where=path) from e
    except IsADirectoryError as e:
        raise PrequantError("is a directory, expected a safetensors file; remove or rename it", where=path) from e
    except OSError as e:  # missing (removed meanwhile), I/O error, ...: whatever it is, name the file
        raise PrequantError(f"cannot read it ({e.strerror or e}); check the file and re-download it", where=path) from e
    return parse_header(path, raw, size)


def header_length(path: Path, prefix: bytes, size: int, *, label: object = None) -> int:
    """The header length a safetensors file's first 8 bytes (`prefix`) announce, checked against the file's
    `size`; works on bytes read locally or fetched by a range request (`label`: the file's name in messages,
    `path` by default)."""
    where = path if label is None else label
    if len(prefix) < 8:
        raise PrequantError(f"file is {size} bytes, too short to be safetensors; re-download it", where=where)
    (n,) = struct.unpack("<Q", prefix)
    if 8 + n > size:
        raise PrequantError(
            f"header length {n} exceeds the file size {size}; the file is truncated or not safetensors, re-download it",
            where=where,
        )
    if n > MAX_HEADER_BYTES:
        raise PrequantError(
            f"header length {n} is over {MAX_HEADER_BYTES} bytes, more than any real checkpoint; the file is corrupt "
            "or not safetensors, re-download it",
            where=where,
        )
    return n


def parse_header(path: Path, raw: bytes, size: int, *, label: object = None) -> tuple[list[TensorRef], dict[str, str]]:
    """Tensors and metadata from a safetensors header given as bytes (`raw`: the JSON after the 8-byte
    length; `size`: the whole file's), e.g. fetched by a range request before the file is downloaded.
    `label` names the file in messages (`path` by default: a Hub shard is named by its repo, not its cache path)."""
    where = path if label is None else label
    try:
        header = json.loads(raw)
    # ValueError covers bad JSON, bad UTF-8 and integers too long to parse; RecursionError, deeply nested junk.
    except (ValueError, RecursionError) as e:
        raise PrequantError(f"header is not valid JSON ({reason(e)}); {CORRUPT}", where=where) from e
    if not isinstance(header, dict):
        raise PrequantError(f"header is not a JSON object; {CORRUPT}", where=where)
    metadata = header.pop("__metadata__", None)
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict):
        raise PrequantError(f"__metadata__ is not a JSON object; {CORRUPT}", where=where)
    data_start = 8 + len(raw)
    refs = [_parse_entry(path, where, name, entry, data_start, size - data_start) for name, entry in header.items()]
    _check_no_overlap(where, refs)
    return refs, {str(k): str(v) for k, v in metadata.items()}


# Dimensions must fit torch's int64 sizes, even for an empty tensor whose other dimensions are huge; the
# rank is bounded so that the product of a hostile shape stays cheap to compute and to print.
_MAX_DIM = 2**63 - 1
_MAX_RANK = 64


def _parse_entry(path: Path, where: object, name: str, entry: object, data_start: int, data_size: int) -> TensorRef:
    tensor = f"tensor {quote(name)}"
    if not isinstance(entry, dict):
        raise PrequantError(f"{tensor}: header entry is not an object; {CORRUPT}", where=where)
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in SAFETENSORS_DTYPES:
        raise PrequantError(
            f"{tensor}: dtype {short(dtype)} is not supported; convert the checkpoint to bf16, fp16 or fp32 first",
            where=where,
        )
    if (
        not isinstance(shape, list)
        or len(shape) > _MAX_RANK
        or not all(_is_int(d) and 0 <= d <= _MAX_DIM for d in shape)
    ):
        raise PrequantError(
            f"{tensor}: shape {short(shape)} is not a list of at most {_MAX_RANK} non-negative integers; {CORRUPT}",
            where=where,
        )
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_int(o) for o in offsets):
        raise PrequantError(f"{tensor}: data_offsets {short(offsets)} is not a pair of integers; {CORRUPT}", where=where)
    begin, end = offsets
    expected = math.prod(shape) * itemsize(dtype)
    if begin < 0 or end < begin or end - begin != expected:
        raise PrequantError(
            f"{tensor}: data_offsets {short(offsets)} do not match {dtype}{short(shape)} ({short(expected)} bytes); "
            f"{CORRUPT}",
            where=where,
        )
    if end > data_size:
        raise PrequantError(
            f"{tensor}: data_offsets {short(offsets)} run past the end of the data ({data_size} bytes after the "
            "header); the file is truncated or corrupt, re-download it",
            where=where,
        )
    return TensorRef(name, dtype, tuple(shape), path, data_start + begin, end - begin)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)  # JSON true/false arrive as bool, a subclass of int


def _check_no_overlap(where: object, refs: list[TensorRef]) -> None:
    previous: TensorRef | None = None
    for ref in sorted(refs, key=lambda r: (r.offset, r.nbytes)):
        if previous is not None and ref.nbytes and ref.offset < previous.offset + previous.nbytes:
            raise PrequantError(
                f"tensors {quote(previous.name)} and {quote(ref.name)} overlap in the file; {CORRUPT}", where=where
            )
        if ref.nbytes:
            previous = ref
