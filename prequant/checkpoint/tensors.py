"""A tensor of a checkpoint, by reference: where its bytes are, with its dtype and shape; and how names and
header values are quoted in one-line messages."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from ..errors import PrequantError

# A `.bin` shard's tensors have no byte range we know of in the file: they are reached through the shard's
# memory-mapped state dict. Nor has a quantized weight's 16-bit form (`QuantizedWeight`): `TensorReader.view` makes it.
BIN_OFFSET = -1


@dataclass(frozen=True)
class TensorRef:
    """Where one source tensor lives: file, byte range, dtype and shape."""

    name: str
    dtype: str  # safetensors code, e.g. "BF16"
    shape: tuple[int, ...]
    file: Path
    offset: int  # absolute offset of the first byte in `file`; BIN_OFFSET: a .bin shard's tensor, a QuantizedWeight
    nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class QuantizedWeight(TensorRef):
    """A weight stored quantized (FP8, INT4 pack-quantized, MXFP4) as the 16-bit tensor it dequantizes to (`dtype`:
    the model's; `shape`: the 16-bit tensor's; `nbytes`: at that dtype). `checkpoint.quantized` makes and dequantizes
    it; the stored tensors it is read from travel with it."""

    stored: TensorRef  # the codes: a float8 weight, an int32 `weight_packed`, uint8 `*_blocks`
    scale: TensorRef
    method: str  # the format: `fp8.BLOCK`, `fp8.CT`, `int4.METHOD`, `mxfp4.METHOD`
    block: tuple[int, int] | None  # elements per scale, rows by columns, where the format has blocks or groups
    extra: tuple[TensorRef, ...] = ()  # other stored tensors its dequantization reads (INT4's zero point)
    checked: tuple[TensorRef, ...] = ()  # stored tensors read on the CPU only, to check it (INT4's shape)
    riders: tuple[TensorRef, ...] = ()  # activation parameters of its module, dropped with it


def merge(per_file: Iterable[list[TensorRef]], fix: str) -> list[TensorRef]:
    """Concatenate the files' tensor lists in order; a name in two files is an error ending with `fix`."""
    seen: dict[str, TensorRef] = {}
    ordered: list[TensorRef] = []
    for refs in per_file:
        for ref in refs:
            if ref.name in seen:
                raise PrequantError(
                    f"tensor {quote(ref.name)} is in both {seen[ref.name].file.name} and {ref.file.name}; {fix}"
                )
            seen[ref.name] = ref
            ordered.append(ref)
    return ordered


def missing(kind: str, ref: TensorRef, part: str) -> PrequantError:
    """The refusal of quantized `ref` (a `kind` tensor: "float8", "INT4", "MXFP4") whose `part` is not in the
    checkpoint."""
    return PrequantError(f"{kind} tensor {quote(ref.name)} has no {part} beside it, and without it its values mean "
                         "nothing; restore the missing tensor (or the shard holding it) and rerun", where=ref.file.name)


def quote(name: str, limit: int = 200) -> str:
    """A tensor name for a message: repr'd (so it stays on one line) and bounded."""
    return repr(name if len(name) <= limit else name[: limit - 3] + "...")


def short(value: object, limit: int = 80) -> str:
    """A header value for a message: one line, bounded (a corrupt header may hold megabytes of junk)."""
    try:
        text = json.dumps(value)
    except (ValueError, TypeError, RecursionError):
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def reason(e: BaseException, limit: int = 120) -> str:
    """An exception as a short one-line reason for a message."""
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."
