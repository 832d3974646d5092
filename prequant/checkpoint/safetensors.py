"""safetensors headers, parsed and checked here (not by the safetensors library), so that every defect of a
file becomes one PrequantError naming the file and tensor, before any work starts.

The rules are the safetensors library's own (`SafeTensors::read_metadata` and `Metadata::validate` in its
Rust crate), each mirrored: at least 8 bytes; a header length of at most 100,000,000 bytes that fits in the
file; the header UTF-8 JSON (serde_json's: no NaN or Infinity, no lone surrogates, at most 127 levels deep)
holding an object whose `__metadata__`, if not null, maps strings to strings and whose every other entry has
a known dtype, a shape of non-negative integers and two non-negative data_offsets; element counts (multiplied
out in order) and byte counts that fit 64 bits; tensors that, sorted by offset, tile the data section with no
overlap and no gap, and a file that ends exactly where the last tensor does. A file safetensors would refuse
is refused here. A few files it would accept are refused too: dtypes torch has no type for, shapes torch
cannot hold (more than 64 dimensions, a dimension past 2^63 - 1), and headers that are not what its writers
write (a key given twice, an entry or a dtype in serde's alternative forms: a JSON array, {"F32": null}).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from ..errors import PrequantError
from .dtypes import SAFETENSORS_DTYPES, itemsize
from .tensors import TensorRef, quote, reason, short

# safetensors' MAX_HEADER_SIZE; real headers are well under it even for thousands of tensors.
MAX_HEADER_BYTES = 100_000_000
MAX_DEPTH = 127  # serde_json's recursion limit: 128 nested arrays or objects are refused
_U64 = 2**64  # safetensors counts elements, bits and bytes in usize: past this, it refuses the shape
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
        # Decoded as UTF-8 first: given bytes, json.loads would also take UTF-16 and UTF-32, which safetensors does not.
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
    # ValueError covers bad JSON, bad UTF-8 and integers too long to parse; RecursionError, deeply nested junk.
    except (ValueError, RecursionError) as e:
        raise PrequantError(f"header is not valid JSON ({reason(e)}); {CORRUPT}", where=where) from e
    if problem := _json_problem(header):
        raise PrequantError(f"header is not valid JSON ({problem}); {CORRUPT}", where=where)
    if not isinstance(header, dict):
        raise PrequantError(f"header is not a JSON object; {CORRUPT}", where=where)
    metadata = header.pop("__metadata__", None)
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict):
        raise PrequantError(f"__metadata__ is not a JSON object; {CORRUPT}", where=where)
    for key, value in metadata.items():
        if not isinstance(value, str):
            raise PrequantError(f"__metadata__ value of {quote(key)} is {short(value)}, not a string; {CORRUPT}",
                                where=where)
    data_start = 8 + len(raw)
    refs = [_parse_entry(path, where, name, entry, data_start, size - data_start) for name, entry in header.items()]
    _check_layout(where, refs, data_start, size)
    return refs, dict(metadata)


class _DuplicateKey(ValueError):
    pass


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict:
    seen: dict = {}
    for key, value in pairs:
        if key in seen:
            raise _DuplicateKey(f"key {quote(key, 60)} appears twice in one object")
        seen[key] = value
    return seen


def _no_constant(name: str) -> object:
    raise ValueError(f"{name} is not JSON")


def _json_problem(value: object) -> str | None:
    """What serde_json would refuse in a value Python's json accepted: nesting past its limit, lone surrogates."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            if depth > MAX_DEPTH:
                return f"nested more than {MAX_DEPTH} levels deep"
            for key, sub in item.items():
                if not _encodable(key):
                    return "a string holds a lone surrogate"
                stack.append((sub, depth + 1))
        elif isinstance(item, list):
            if depth > MAX_DEPTH:
                return f"nested more than {MAX_DEPTH} levels deep"
            stack.extend((sub, depth + 1) for sub in item)
        elif isinstance(item, str) and not _encodable(item):
            return "a string holds a lone surrogate"
    return None


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


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
    count = 1
    for d in shape:  # multiplied in order, as safetensors does: [2**33, 2**33, 0] overflows before the 0
        count *= d
        if count >= _U64:
            raise PrequantError(
                f"{tensor}: shape {short(shape)} has more elements than a 64-bit count holds; {CORRUPT}", where=where
            )
    begin, end = offsets
    expected = count * itemsize(dtype)
    if expected * 8 >= _U64:
        raise PrequantError(f"{tensor}: shape {short(shape)} has more bits than a 64-bit count holds; {CORRUPT}",
                            where=where)
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


def _check_layout(where: object, refs: list[TensorRef], data_start: int, size: int) -> None:
    """Sorted by offset, the tensors tile the data section exactly: no overlap, no gap, nothing after the last."""
    ordered = sorted(refs, key=lambda r: (r.offset, r.offset + r.nbytes))
    end = data_start
    for previous, ref in zip([None, *ordered], ordered):
        if ref.offset < end:
            raise PrequantError(
                f"tensors {quote(previous.name)} and {quote(ref.name)} overlap in the file; {CORRUPT}", where=where
            )
        end = ref.offset + ref.nbytes
    end = data_start
    for ref in ordered:
        if ref.offset > end:
            raise PrequantError(
                f"tensor {quote(ref.name)} starts at data offset {ref.offset - data_start}, but the tensor before it "
                f"ends at {end - data_start}: bytes no tensor owns; {CORRUPT}",
                where=where,
            )
        end = ref.offset + ref.nbytes
    if end != size:
        raise PrequantError(
            f"{size - end} bytes follow the last tensor's data (the data section is {size - data_start} bytes, the "
            f"tensors cover {end - data_start}); {CORRUPT}",
            where=where,
        )
