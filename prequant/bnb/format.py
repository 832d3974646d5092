"""The bitsandbytes 4-bit checkpoint format, as transformers writes it: the one module that knows it.

For each quantized weight `W` (e.g. ``model.layers.0.mlp.down_proj.weight``) of `n` elements, a checkpoint holds:

| key                                  | dtype and shape                                                        |
|--------------------------------------|------------------------------------------------------------------------|
| `W`                                  | packed codes: `packed_length(n, storage)` elements of the storage dtype, as `[count, 1]` |
| `W.absmax`                           | F32 `[blocks]`; U8 `[blocks]` (8-bit codes) with double quant            |
| `W.quant_map`                        | F32 `[16]`: the NF4 or FP4 code table                                   |
| `W.nested_absmax`                    | F32 `[ceil(blocks / 256)]`, double quant only                           |
| `W.nested_quant_map`                 | F32 `[256]`: bitsandbytes' dynamic 8-bit map, double quant only         |
| `W.quant_state.bitsandbytes__nf4`    | U8: the quant state as JSON text (`__fp4` for FP4)                      |

Codes are two per byte, element 2j in the high nibble; blocks are consecutive runs of the flattened row-major
tensor. With double quantization the absmax values, minus their mean (`nested_offset`), are quantized 8-bit in
blocks of 256. `config.json` gets the `quantization_config` of `quantization_config()`. Everything else in
prequant (the planner, the quantizer, the writer, verify, the FSDP loader) asks this module.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from ..checkpoint.codes import ITEMSIZE
from ..errors import UsageError, one_of, spelled

QUANT_TYPES = ("nf4", "fp4")
BLOCKSIZES = (64, 128, 256, 512, 1024, 2048, 4096)
NESTED_BLOCKSIZE = 256
NESTED_DTYPE = "float32"
# How the CLI and config.json spell the dtypes, and their safetensors codes.
STORAGE_CODES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "uint8": "U8"}
STORAGE_NAMES = tuple(STORAGE_CODES)
COMPUTE_NAMES = ("bfloat16", "float16", "float32")  # also the dtypes a quant state may record
# The options whose values are one of a few; names in lower case ("NF4" is what bitsandbytes' docs and cards print).
CHOICES: dict[str, tuple] = {"quant_type": QUANT_TYPES, "blocksize": BLOCKSIZES, "compute_dtype": COMPUTE_NAMES,
                             "quant_storage": STORAGE_NAMES}
QUANTIZABLE = ("BF16", "F16", "F32")  # safetensors codes of the inputs bitsandbytes' kernels take
# The companions of a packed weight, by their entry name (what follows "W." in a key).
COMPANIONS = ("absmax", "quant_map", "nested_absmax", "nested_quant_map")
STATE_PREFIX = "quant_state.bitsandbytes__"
_STATE_MARK = "." + STATE_PREFIX
# The keys of a quant state's JSON, in the order bitsandbytes writes them.
STATE_KEYS = ("quant_type", "blocksize", "dtype", "shape")
NESTED_STATE_KEYS = ("nested_blocksize", "nested_dtype", "nested_offset")


def choice(name: str, value: object, *, given: object = None) -> object:
    """`value` of option `name` (a key of CHOICES) as the table writes it, a name in any case taken; a UsageError
    names the option as its caller wrote it (`--quant-type NF5`, or `quant_type='NF5'`; `given`: the
    value the caller passed, when `value` is its name)."""
    normal = value.lower() if isinstance(value, str) else value
    if normal not in CHOICES[name]:
        shown = value if given is None else given
        raise UsageError(f"{spelled(name, shown)} is not supported; use {one_of(CHOICES[name])}")
    return normal


@dataclass(frozen=True)
class Settings:
    """Quantization settings; the same names as BitsAndBytesConfig, checked on creation (a refusal names the
    keyword, as `quantize_tensor`'s caller wrote it; `conversion.options` checks convert's first, as its caller
    wrote them)."""

    quant_type: str = "nf4"
    double_quant: bool = True
    blocksize: int = 64
    compute_dtype: str = "bfloat16"
    quant_storage: str = "bfloat16"

    def __post_init__(self) -> None:
        if self.quant_type not in QUANT_TYPES:
            raise UsageError(f"quant_type={self.quant_type!r} is not supported; use nf4 or fp4")
        if self.blocksize not in BLOCKSIZES:
            raise UsageError(f"blocksize={self.blocksize!r} is not supported; use one of {BLOCKSIZES}")
        if self.compute_dtype not in COMPUTE_NAMES:
            raise UsageError(f"compute_dtype={self.compute_dtype!r} is not supported; use {', '.join(COMPUTE_NAMES)}")
        if self.quant_storage not in STORAGE_NAMES:
            raise UsageError(f"quant_storage={self.quant_storage!r} is not supported; use {', '.join(STORAGE_NAMES)}")

    @property
    def state_entry(self) -> str:
        """The quant state's entry name among a weight's entries (as `quantize_tensor` returns them)."""
        return STATE_PREFIX + self.quant_type

    @property
    def storage_code(self) -> str:
        """The safetensors dtype code the packed weights are stored as."""
        return STORAGE_CODES[self.quant_storage]


# ----------------------------------------------------------------------------------------------- keys


def state_key(weight_key: str, quant_type: str) -> str:
    """The checkpoint key of a packed weight's quant-state JSON (bitsandbytes' naming)."""
    return f"{weight_key}{_STATE_MARK}{quant_type}"


def split_state_key(key: str) -> tuple[str, str] | None:
    """(weight key, quant type) when `key` names a quant-state JSON, else None."""
    weight, mark, quant_type = key.partition(_STATE_MARK)
    return (weight, quant_type) if mark else None


def entry_key(weight_key: str, entry: str) -> str:
    """The checkpoint key of one of a weight's entries ("weight", "absmax", ..., "quant_state.bitsandbytes__nf4")."""
    return weight_key if entry == "weight" else f"{weight_key}.{entry}"


def entry_name(weight_key: str, key: str) -> str:
    """The inverse of `entry_key`: which entry of `weight_key` the checkpoint key `key` is."""
    return "weight" if key == weight_key else key.removeprefix(weight_key + ".")


# ------------------------------------------------------------------------------------- sizes and layout


def blocks(n: int, blocksize: int) -> int:
    """Absmax blocks of an `n`-element tensor."""
    return -(-n // blocksize)


def packed_length(n: int, storage_code: str) -> int:
    """Storage elements bitsandbytes allocates for the packed codes of `n` elements: (n + 1) // (2 * itemsize).

    Codes take ceil(n / 2) bytes; for a storage dtype wider than a byte this rounds down, so an element count
    that is not a multiple of 2 * itemsize loses the last codes' byte (bitsandbytes' own sizing)."""
    return (n + 1) // (2 * ITEMSIZE[storage_code])


def packed_bytes(n: int) -> int:
    """Bytes the packed codes of `n` elements need: two codes per byte."""
    return -(-n // 2)


def loses_codes(n: int, storage_code: str) -> bool:
    """Whether bitsandbytes' storage for `n` elements (`packed_length`) is smaller than the codes it must hold:
    the last byte is lost and the tensor cannot be dequantized (e.g. 37 x 98 in bfloat16: 1,812 of 1,813 bytes).
    A uint8 storage never loses any."""
    return packed_length(n, storage_code) * ITEMSIZE[storage_code] < packed_bytes(n)


@dataclass(frozen=True)
class Entry:
    """One key of a quantized weight in a checkpoint; `shape` is None for the quant-state JSON, whose length is
    known only once the tensor is quantized (it holds the double-quant offset in decimal)."""

    key: str
    dtype: str  # safetensors code
    shape: tuple[int, ...] | None


def entries(
    weight_key: str, n: int, *, quant_type: str, blocksize: int, double_quant: bool, storage_code: str
) -> tuple[Entry, ...]:
    """Every key transformers writes for a 4-bit weight of `n` elements, with its dtype and shape."""
    nblocks = blocks(n, blocksize)
    out = [
        Entry(weight_key, storage_code, (packed_length(n, storage_code), 1)),
        Entry(entry_key(weight_key, "absmax"), "U8" if double_quant else "F32", (nblocks,)),
        Entry(entry_key(weight_key, "quant_map"), "F32", (16,)),
    ]
    if double_quant:
        out += [
            Entry(entry_key(weight_key, "nested_absmax"), "F32", (blocks(nblocks, NESTED_BLOCKSIZE),)),
            Entry(entry_key(weight_key, "nested_quant_map"), "F32", (256,)),
        ]
    out.append(Entry(state_key(weight_key, quant_type), "U8", None))
    return tuple(out)


def settings_entries(weight_key: str, n: int, settings: Settings) -> tuple[Entry, ...]:
    """`entries` for the settings of a conversion."""
    return entries(weight_key, n, quant_type=settings.quant_type, blocksize=settings.blocksize,
                   double_quant=settings.double_quant, storage_code=settings.storage_code)


# ------------------------------------------------------------------------------------------ quant state


def quant_state(
    quant_type: str, blocksize: int, dtype: str, shape: list[int], nested_offset: float | None = None
) -> dict:
    """The quant state bitsandbytes records for a tensor (`dtype`: the input's, e.g. "bfloat16"), in its key order;
    `nested_offset` (the mean of the absmax values) marks double quantization."""
    state: dict = {"quant_type": quant_type, "blocksize": blocksize, "dtype": dtype, "shape": list(shape)}
    if nested_offset is not None:
        state.update(nested_blocksize=NESTED_BLOCKSIZE, nested_dtype=NESTED_DTYPE, nested_offset=nested_offset)
    return state


def encode_quant_state(state: dict) -> bytes:
    """The JSON text bitsandbytes packs into the quant-state tensor (json.dumps defaults, the state's key order)."""
    return json.dumps(state).encode()


def decode_quant_state(raw: bytes) -> object:
    """The quant state a quant-state tensor's bytes hold (ValueError or UnicodeDecodeError when not JSON)."""
    return json.loads(raw)


def is_nested(state: dict) -> bool:
    """Whether a quant state describes a double-quantized tensor."""
    return "nested_blocksize" in state or "nested_offset" in state


def quant_state_problems(state: object, quant_type: str) -> list[str]:
    """What is wrong with a decoded quant state found under a key ending in `__<quant_type>` (empty: nothing)."""
    if not isinstance(state, dict):
        return ["is not a JSON object"]
    nested = is_nested(state)
    required = set(STATE_KEYS) | (set(NESTED_STATE_KEYS) if nested else set())
    problems = []
    if missing := sorted(required - state.keys()):
        problems.append(f"lacks {', '.join(missing)}")
    if unknown := sorted(state.keys() - required):
        problems.append(f"has unexpected {', '.join(unknown)}")
    if quant_type not in QUANT_TYPES or state.get("quant_type") != quant_type:
        problems.append(f"quant_type {state.get('quant_type')!r} does not match the key's __{quant_type}")
    if state.get("blocksize") not in BLOCKSIZES:
        problems.append(f"blocksize {state.get('blocksize')!r} is not one of {BLOCKSIZES}")
    if state.get("dtype") not in COMPUTE_NAMES:  # the dtype the weight had: one bitsandbytes computes in
        problems.append(f"dtype {state.get('dtype')!r} is not one of {', '.join(COMPUTE_NAMES)}")
    shape = state.get("shape")
    if not isinstance(shape, list) or not shape or not all(_is_int(d) and d > 0 for d in shape):
        problems.append(f"shape {shape!r} is not a list of positive integers")
    if nested:
        if state.get("nested_blocksize") != NESTED_BLOCKSIZE:
            problems.append(f"nested_blocksize {state.get('nested_blocksize')!r} is not {NESTED_BLOCKSIZE}")
        if state.get("nested_dtype") != NESTED_DTYPE:
            problems.append(f"nested_dtype {state.get('nested_dtype')!r} is not {NESTED_DTYPE!r}")
        offset = state.get("nested_offset")
        if not isinstance(offset, (int, float)) or isinstance(offset, bool) or not math.isfinite(offset):
            problems.append(f"nested_offset {offset!r} is not a finite number")
    return problems


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


# ------------------------------------------------------------------------------------------- the config


def quantization_config(settings: Settings, skip_modules: list[str] | None) -> dict:
    """The quantization_config transformers writes into config.json for BitsAndBytesConfig with these settings."""
    return {
        "_load_in_4bit": True,
        "_load_in_8bit": False,
        "bnb_4bit_compute_dtype": settings.compute_dtype,
        "bnb_4bit_quant_storage": settings.quant_storage,
        "bnb_4bit_quant_type": settings.quant_type,
        "bnb_4bit_use_double_quant": settings.double_quant,
        "llm_int8_enable_fp32_cpu_offload": False,
        "llm_int8_has_fp16_weight": False,
        "llm_int8_skip_modules": skip_modules,
        "llm_int8_threshold": 6.0,
        "load_in_4bit": True,
        "load_in_8bit": False,
        "quant_method": "bitsandbytes",
    }
