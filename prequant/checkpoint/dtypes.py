"""Names of dtypes as they appear in safetensors headers, torch and the CLI, in one place."""

from __future__ import annotations

import torch

from .codes import ITEMSIZE

# safetensors header code -> torch dtype. Codes torch does not have are left out on purpose:
# a checkpoint using them is refused by the reader with a message that names the tensor.
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "U16": torch.uint16,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I32": torch.int32,
    "U32": torch.uint32,
    "F32": torch.float32,
    "F64": torch.float64,
    "I64": torch.int64,
    "U64": torch.uint64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
TORCH_TO_SAFETENSORS: dict[torch.dtype, str] = {v: k for k, v in SAFETENSORS_DTYPES.items()}

# CLI / config spelling -> torch dtype.
NAMED: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "uint8": torch.uint8,
}


def itemsize(code: str) -> int:
    """Bytes per element of a safetensors dtype code."""
    return ITEMSIZE[code]


def torch_name(dtype: torch.dtype) -> str:
    """'torch.bfloat16' -> 'bfloat16', the spelling bitsandbytes writes into quant-state JSON."""
    return str(dtype).removeprefix("torch.")
