"""The reader against hostile bytes: random and mutated safetensors files, headers and indexes.

Whatever the input, `read_header` / `scan_files` / `check_index` / `source.local` either return results that are
consistent with the file (every tensor's bytes inside the data section, sized by dtype and shape, no two
tensors sharing bytes, each viewable) or raise PrequantError, the error the CLI turns into one line. Any
other exception would reach the user as a traceback.

The safetensors library itself is the oracle for what a valid file is: whatever `read_header` accepts,
safetensors opens too; whatever safetensors opens, `read_header` accepts, except for the few stricter rules
its docstring lists (refused with the messages in `STRICTER`).
"""

from __future__ import annotations

import atexit
import itertools
import json
import math
import re
import shutil
import struct
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, currently_in_test_context, event, given, settings
from hypothesis import strategies as st

from prequant.checkpoint import hf_files, reader, safetensors, tensors
from prequant.checkpoint.dtypes import SAFETENSORS_DTYPES, itemsize
from prequant.source import spec as source
from prequant.errors import PrequantError

# Bounded: the whole file runs in well under a minute on two cores; no example database in the repo.
FUZZ = settings(max_examples=250, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])

CODES = sorted(SAFETENSORS_DTYPES)
SCRATCH = Path(tempfile.mkdtemp(prefix="prequant-fuzz-"))  # hypothesis examples cannot take tmp_path
atexit.register(shutil.rmtree, SCRATCH, True)  # also when collected but deselected


# --- strategies ----------------------------------------------------------------------------------

# Tensor names; "__metadata__" is the format's reserved key, not a tensor (hypothesis does try it: it draws
# string constants from the code under test).
names = st.text(st.characters(codec="utf-8", exclude_characters="\x00"), min_size=1, max_size=12).filter(
    lambda n: n != "__metadata__"
)
scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)  # negatives and numbers past int64
    | st.integers(-3, 300)  # small ones, which sometimes land on a plausible offset or size
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8)
    | st.sampled_from([*CODES, "F4", "Q4_K", "bf16", "", "F8_E8M0"])
)
junk = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)
plausible_shape = st.lists(st.integers(0, 9), max_size=3)
plausible_offsets = st.lists(st.integers(-2, 400), min_size=2, max_size=2)

# A valid file's tensors: (name, dtype code, shape); unique names.
tensor_specs = st.lists(st.tuples(names, st.sampled_from(CODES), plausible_shape), max_size=5, unique_by=lambda t: t[0])


def layout(specs: list[tuple[str, str, list[int]]]) -> dict:
    """The header of a valid safetensors file holding `specs`, data packed back to back."""
    header: dict = {"__metadata__": {"format": "pt"}}
    pos = 0
    for name, dtype, shape in specs:
        n = math.prod(shape) * itemsize(dtype)
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [pos, pos + n]}
        pos += n
    return header


def data_size(header: dict) -> int:
    return max((e["data_offsets"][1] for k, e in header.items() if k != "__metadata__"), default=0)


def encode(header: dict | bytes, data: bytes, declared: int | None = None) -> bytes:
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text) if declared is None else declared) + text + data


def write(raw: bytes, name: str = "model.safetensors") -> Path:
    path = SCRATCH / name
    path.write_bytes(raw)
    return path


# --- the property --------------------------------------------------------------------------------


def check_refs(path: Path, refs: list[tensors.TensorRef]) -> None:
    """What an accepted file must satisfy for the rest of prequant to be safe reading it."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    data_start, size = 8 + n, len(raw)
    for ref in refs:
        assert ref.file == path
        assert ref.dtype in SAFETENSORS_DTYPES
        assert all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in ref.shape)
        assert ref.nbytes == math.prod(ref.shape) * itemsize(ref.dtype)
        assert data_start <= ref.offset and ref.offset + ref.nbytes <= size, (ref, data_start, size)
    spans = sorted((r.offset, r.offset + r.nbytes) for r in refs if r.nbytes)
    for (_, end), (begin, _) in itertools.pairwise(spans):
        assert end <= begin, spans
    # Downstream, every accepted tensor is viewed through the memory map: that must work too.
    with reader.TensorReader() as data:
        for ref in refs:
            assert tuple(data.view(ref).shape) == ref.shape


def only_prequant_errors(call: Callable[[], object]) -> object | None:
    """Run `call`; PrequantError is an accepted outcome (returns None), anything else fails the test."""
    try:
        return call()
    except PrequantError as e:
        assert "\n" not in e.message  # printed as one line
        return None


# Refusals of files the safetensors library opens (read_header's docstring says why): dtypes torch lacks, shapes
# torch cannot hold, a key twice, an entry or a dtype in serde's alternative forms (array, {"F32": null}).
STRICTER = re.compile(
    r"dtype .* is not supported|shape .* is not a list of at most 64 non-negative integers|appears twice in one "
    r"object|header entry is not an object"
)


def safetensors_opens(path: Path) -> list[str] | None:
    """The tensor names the safetensors library reads from the file's header, or None when it refuses the file."""
    from safetensors import safe_open

    try:
        with safe_open(path, "np") as f:
            return sorted(f.keys())
    except Exception:  # noqa: BLE001 - its refusals come as several exception types
        return None


def read_and_check(path: Path) -> None:
    refusal: list[PrequantError] = []

    def read() -> object:
        try:
            return safetensors.read_header(path)
        except PrequantError as e:
            refusal.append(e)
            raise

    result = only_prequant_errors(read)
    # Shown by --hypothesis-show-statistics: both outcomes must occur, or the search is not reaching the checks.
    if currently_in_test_context():
        event("refused" if result is None else "accepted")
    opened = safetensors_opens(path) if path.is_file() else None
    if result is not None:
        refs, metadata = result
        assert all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())
        check_refs(path, refs)
        assert opened == sorted(r.name for r in refs), "accepted a file the safetensors library refuses"
    elif opened is not None:
        assert STRICTER.search(refusal[0].message), f"safetensors opens it, refused: {refusal[0].message[:300]}"


# --- valid files ---------------------------------------------------------------------------------


@FUZZ
@given(specs=tensor_specs)
def test_valid_files_are_read_exactly(specs: list[tuple[str, str, list[int]]]) -> None:
    header = layout(specs)
    path = write(encode(header, (bytes(range(256)) * (data_size(header) // 256 + 1))[: data_size(header)]))
    refs, metadata = safetensors.read_header(path)
    assert metadata == {"format": "pt"}
    assert {(r.name, r.dtype, r.shape) for r in refs} == {(n, d, tuple(s)) for n, d, s in specs}
    check_refs(path, refs)


# --- mutated files -------------------------------------------------------------------------------


@FUZZ
@given(
    specs=tensor_specs, flips=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1, max_size=6)
)
def test_byte_flips(specs: list, flips: list[tuple[int, int]]) -> None:
    header = layout(specs)
    raw = bytearray(encode(header, b"\x01" * data_size(header)))
    for pos, value in flips:
        raw[pos % len(raw)] = value  # anywhere: the length prefix, the JSON text (bad UTF-8 included), the data
    read_and_check(write(bytes(raw)))


@FUZZ
@given(specs=tensor_specs, keep=st.integers(0, 10**6), extra=st.binary(max_size=16))
def test_truncated_or_extended(specs: list, keep: int, extra: bytes) -> None:
    header = layout(specs)
    raw = encode(header, b"\x02" * data_size(header))
    read_and_check(write(raw[: keep % (len(raw) + 1)] + extra))


@FUZZ
@given(
    specs=tensor_specs.filter(bool),
    which=st.integers(0, 10),
    field=st.sampled_from(["dtype", "shape", "data_offsets", "<entry>", "<missing>", "__metadata__"]),
    value=junk | plausible_shape | plausible_offsets,
)
def test_random_json_values_in_the_header(specs: list, which: int, field: str, value: object) -> None:
    header = layout(specs)
    size = data_size(header)
    name = specs[which % len(specs)][0]
    if field == "<entry>":
        header[name] = value
    elif field == "<missing>":
        del header[name][["dtype", "shape", "data_offsets"][which % 3]]
    elif field == "__metadata__":
        header["__metadata__"] = value
    else:
        header[name][field] = value
    read_and_check(write(encode(header, b"\x03" * size)))


@FUZZ
@given(header=junk, declared=st.one_of(st.none(), st.integers(0, 2**64 - 1)), data=st.binary(max_size=64))
def test_arbitrary_json_header_and_length(header: object, declared: int | None, data: bytes) -> None:
    text = json.dumps(header).encode()
    read_and_check(write(encode(text, data, declared)))


@FUZZ
@given(raw=st.binary(max_size=200))
def test_arbitrary_bytes(raw: bytes) -> None:
    read_and_check(write(raw))


# Inputs a random search rarely builds but an attacker would: each once, explicitly.
NASTY_HEADERS = {
    "deeply nested": b"[" * 100_000 + b"]" * 100_000,
    "integer too long to parse": b'{"t": {"dtype": "F32", "shape": [' + b"9" * 5000 + b'], "data_offsets": [0, 4]}}',
    "utf-16 text": '{"t": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}'.encode("utf-16"),
    "dtype is a list": b'{"t": {"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]}}',
    "dtype is an object": b'{"t": {"dtype": {"F32": 1}, "shape": [1], "data_offsets": [0, 4]}}',
    "empty tensor with a dimension past int64": b'{"t": {"dtype": "F32", "shape": [0, 18446744073709551616], "data_offsets": [0, 0]}}',
    "thousands of dimensions": b'{"t": {"dtype": "F32", "shape": ['
    + b",".join([b"1"] * 5000)
    + b'], "data_offsets": [0, 4]}}',
    "shape of bools": b'{"t": {"dtype": "F32", "shape": [true], "data_offsets": [0, 4]}}',
    "offsets as floats": b'{"t": {"dtype": "F32", "shape": [1], "data_offsets": [0.0, 4.0]}}',
    "NaN offsets": b'{"t": {"dtype": "F32", "shape": [1], "data_offsets": [NaN, 4]}}',
    "metadata is a list": b'{"__metadata__": [], "t": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}',
    "metadata is false": b'{"__metadata__": false}',
    "header is a string": b'"model"',
    "header is empty": b"",
    "huge tensor name": b'{"' + b"n" * 1_000_000 + b'": {"dtype": "X", "shape": [], "data_offsets": [0, 0]}}',
    "newline in a tensor name": b'{"a\\nb": {"dtype": "X", "shape": [], "data_offsets": [0, 0]}}',
}


# Every one of them is refused; what the refusal says after "<file>: ".
NASTY_REFUSALS = {
    "deeply nested": "header is not valid JSON",
    "integer too long to parse": "header is not valid JSON",
    "utf-16 text": "header is not valid JSON",
    "dtype is a list": """tensor 't': dtype ["F32"] is not supported""",
    "dtype is an object": """tensor 't': dtype {"F32": 1} is not supported""",
    "empty tensor with a dimension past int64": (
        "tensor 't': shape [0, 18446744073709551616] is not a list of at most 64 non-negative integers"
    ),
    "thousands of dimensions": "tensor 't': shape [1, 1, 1, ",
    "shape of bools": "tensor 't': shape [true] is not a list of at most 64 non-negative integers",
    "offsets as floats": "tensor 't': data_offsets [0.0, 4.0] is not a pair of integers",
    "NaN offsets": "header is not valid JSON (NaN is not JSON)",  # serde_json has no NaN
    "metadata is a list": "__metadata__ is not a JSON object",
    "metadata is false": "__metadata__ is not a JSON object",
    "header is a string": "header is not a JSON object",
    "header is empty": "header is not valid JSON",
    "huge tensor name": "tensor 'nnnnnnnn",
    "newline in a tensor name": """tensor 'a\\nb': dtype "X" is not supported""",
}


@pytest.mark.parametrize("name", list(NASTY_HEADERS))
def test_nasty_headers(name: str) -> None:
    assert NASTY_HEADERS.keys() == NASTY_REFUSALS.keys()
    path = write(encode(NASTY_HEADERS[name], b"\x00" * 8))
    read_and_check(path)
    with pytest.raises(PrequantError) as refused:
        safetensors.read_header(path)
    message = refused.value.message
    assert type(refused.value) is PrequantError and refused.value.exit_code == 1  # a bad file, not a usage error
    assert message.startswith(f"{path}: {NASTY_REFUSALS[name]}"), message[:300]
    assert "\n" not in message and len(message) < 1000, message[:300]  # one readable line, even for a 1 MB name


def _entry(dtype: str = "F32", shape: list[int] | None = None, offsets: list[int] | None = None, **extra: object) -> dict:
    return {"dtype": dtype, "shape": [1] if shape is None else shape, "data_offsets": offsets or [0, 4], **extra}


# Files the safetensors library refuses, each with what read_header's refusal says (after "<file>: ").
DEFECTS: dict[str, tuple[bytes | dict, bytes, str]] = {
    "trailing bytes after the data": ({"t": _entry()}, b"\0" * 4 + b"junk", "4 bytes follow the last tensor's data"),
    "a hole between two tensors": (
        {"a": _entry(), "b": _entry(offsets=[8, 12])}, b"\0" * 12, "tensor 'b' starts at data offset 8, but the"
    ),
    "a hole before the first tensor": ({"t": _entry(offsets=[4, 8])}, b"\0" * 8, "tensor 't' starts at data offset 4"),
    "an empty tensor inside another": (
        {"a": _entry(shape=[2], offsets=[0, 8]), "z": _entry(shape=[0], offsets=[4, 4])}, b"\0" * 8,
        "tensors 'a' and 'z' overlap",
    ),
    "a metadata value that is not a string": (
        {"__metadata__": {"format": "pt", "step": 7}, "t": _entry()}, b"\0" * 4,
        "__metadata__ value of 'step' is 7, not a string",
    ),
    "an element count past 64 bits": (
        {"t": _entry(shape=[2**33, 2**33, 0], offsets=[0, 0])}, b"", "tensor 't': shape [8589934592, 8589934592, 0] has"
    ),
    "a bit count past 64 bits": ({"t": _entry(shape=[2**61], offsets=[0, 2**63])}, b"", "tensor 't': shape [2305843009213693952] has more bits"),
    "NaN in an unknown field": (b'{"t": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4], "x": NaN}}', b"\0" * 4,
                                "header is not valid JSON (NaN is not JSON)"),
    "a lone surrogate in a name": (b'{"\\ud800": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}', b"\0" * 4,
                                   "header is not valid JSON (a string holds a lone surrogate)"),
    "UTF-16 text without a byte-order mark": (
        '{"t": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}'.encode("utf-16-le"), b"\0" * 4,
        "header is not valid JSON",
    ),
    "__metadata__ twice": (b'{"__metadata__": {}, "__metadata__": {}}', b"", "header is not valid JSON (key '__metadata__' appears twice"),
    "nested 128 levels deep": (
        b'{"t": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4], "x": ' + b"[" * 126 + b"]" * 126 + b"}}",
        b"\0" * 4, "header is not valid JSON (nested more than 127 levels deep)",
    ),
}


@pytest.mark.parametrize("name", list(DEFECTS))
def test_every_defect_safetensors_refuses_is_refused(name: str) -> None:
    header, data, says = DEFECTS[name]
    path = write(encode(header if isinstance(header, bytes) else json.dumps(header).encode(), data))
    assert safetensors_opens(path) is None, "the safetensors library opens this file: not a defect"
    with pytest.raises(PrequantError) as refused:
        safetensors.read_header(path)
    assert refused.value.message.startswith(f"{path}: {says}"), refused.value.message[:300]
    read_and_check(path)


def test_header_length_is_bounded_as_safetensors_bounds_it() -> None:
    """100,000,000 bytes, safetensors' MAX_HEADER_SIZE (a sparse file: nothing is written but the length)."""
    path = SCRATCH / "huge-header.safetensors"
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", 100_000_001))
        f.truncate(8 + 100_000_001)
    try:
        assert safetensors_opens(path) is None
        with pytest.raises(PrequantError, match="header length 100000001 is over 100000000 bytes"):
            safetensors.read_header(path)
    finally:
        path.unlink()


@pytest.mark.parametrize("header", [
    {"__metadata__": None, "t": _entry()},
    {"t": _entry(unknown={"kept": [1, 2.5, None]})},
    {"t": _entry(), "z": _entry(shape=[0, 5], offsets=[4, 4])},
    {},
], ids=["null metadata", "unknown field", "empty tensor at the end", "no tensors"])
def test_files_safetensors_opens_are_read(header: dict) -> None:
    data = b"\0" * (4 if header.get("t") else 0)
    path = write(encode(json.dumps(header).encode(), data))
    assert safetensors_opens(path) is not None
    refs, _ = safetensors.read_header(path)
    assert sorted(r.name for r in refs) == safetensors_opens(path)


def test_unreadable_paths_are_prequant_errors() -> None:
    for path in (SCRATCH / "missing.safetensors", SCRATCH, Path("/proc/self/mem")):
        assert only_prequant_errors(lambda p=path: safetensors.read_header(p)) is None


# --- several files, and the index ----------------------------------------------------------------


@FUZZ
@given(first=tensor_specs, second=tensor_specs)
def test_scan_refuses_a_tensor_in_two_files(first: list, second: list) -> None:
    a = write(encode(layout(first), b"\x04" * data_size(layout(first))), "a.safetensors")
    b = write(encode(layout(second), b"\x05" * data_size(layout(second))), "b.safetensors")
    refs = only_prequant_errors(lambda: reader.scan_files([a, b]))
    shared = {n for n, _, _ in first} & {n for n, _, _ in second}
    assert (refs is None) == bool(shared)
    if refs is not None:
        # Order: file by file, then by offset within a file (the order the pipeline reads in).
        assert [(r.file != a, r.offset) for r in refs] == sorted((r.file != a, r.offset) for r in refs)
        assert len({r.name for r in refs}) == len(refs) == len(first) + len(second)


file_names = st.sampled_from(
    [
        "a.safetensors",
        "b.safetensors",
        "../a.safetensors",
        "/etc/passwd",
        ".",
        "..",
        "",
        "sub/a.safetensors",
        "a\\b.safetensors",
        "x" * 300,
        "nul\x00.safetensors",
        "missing.safetensors",
    ]
) | st.text(max_size=20)


@FUZZ
@given(
    index=junk
    | st.dictionaries(st.text(max_size=8), st.dictionaries(names, file_names | junk, max_size=4), max_size=2),
    weight_map=st.none() | st.dictionaries(names, file_names, max_size=5),
)
def test_random_indexes(index: object, weight_map: dict | None) -> None:
    root = SCRATCH / "ckpt"
    root.mkdir(exist_ok=True)
    specs = [("t0", "F32", [2]), ("t1", "BF16", [3])]
    for name in ("a.safetensors", "b.safetensors"):
        (root / name).write_bytes(encode(layout(specs), b"\x06" * 16))
    if weight_map is not None:
        index = {"metadata": {}, "weight_map": weight_map}
    index_path = root / "model.safetensors.index.json"
    index_path.write_text(json.dumps(index))
    src = only_prequant_errors(lambda: source.local(str(root), root))
    if src is not None:
        assert all(p.parent == root and p.is_file() for p in src.weight_files)
        tensors = only_prequant_errors(lambda: reader.scan_files(src.weight_files))
        if tensors is not None:
            only_prequant_errors(lambda: hf_files.check_index(index_path, tensors))
    # check_index on its own, against whatever the index holds.
    only_prequant_errors(lambda: hf_files.check_index(index_path, []))
