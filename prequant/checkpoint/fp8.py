"""FP8 weights: the two on-disk formats and their dequantization (`quantized` groups and reads them).

Two formats, declared by config.json's `quantization_config`:

- block-scaled (`quant_method: "fp8"`, `weight_block_size: [bm, bn]`; DeepSeek-V3/R1, Kimi-K2, Qwen3 -FP8):
  `P.weight` float8_e4m3fn [M, N] and `P.weight_scale_inv` [ceil(M/bm), ceil(N/bn)], one scale per block, the edge
  blocks partial. DeepSeek's `weight_dequant` (inference/kernel.py) is the reference: `x.float() * s` per block,
  stored in the default (the model's) dtype; transformers' `Fp8Dequantize` gives the same bytes where the blocks
  divide the weight.
- compressed-tensors FP8 (`quant_method: "compressed-tensors"`, `format: "float-quantized"`): `P.weight` float8_e4m3fn
  and `P.weight_scale`, per tensor (shape (1,) or ()) or per output channel ([M, 1]). compressed-tensors'
  `dequantize` (quantization/lifecycle/forward.py) is the reference: `x_q.to(scale.dtype) * scale`, then the model's
  dtype on load. A 16-bit scale's product is the float32 product rounded to that dtype (exact operands: torch
  multiplies 16-bit floats in float32), so both formats are one rule: the product in float32, rounded to a 16-bit
  scale's dtype for compressed-tensors, then to the model's dtype.

A float8 weight becomes a `QuantizedWeight` under its own name, its scale (possibly in another shard) folded into it.

Standard library only at import.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ..errors import PrequantError
from . import lookup
from .lookup import ITEMSIZE, Each
from .tensors import BIN_OFFSET, QuantizedWeight, TensorRef, missing, quote

if TYPE_CHECKING:
    import torch

BLOCK = "fp8"  # transformers' and DeepSeek's block-scaled format
CT = "compressed-tensors"
METHODS = (BLOCK, CT)
NAME = "FP8"
SCALE = {BLOCK: "weight_scale_inv", CT: "weight_scale"}  # P.weight's scale is P.<this>
PARTS = "a scale per weight"
NONE = "no tensor is float8"
SCALE_DTYPES = ("F32", "BF16", "F16")


def declares(qc: dict) -> bool:
    """Whether a `quantization_config` declares one of the FP8 formats."""
    return qc.get("quant_method") == BLOCK or (qc.get("quant_method") == CT and qc.get("format") == "float-quantized")


def group(tensors: list[TensorRef], qc: dict, model_dtype: str, where: object) -> dict[str, QuantizedWeight]:
    """Each float8 weight as a `QuantizedWeight` (by its name) with its scale, as `qc` declares them."""
    method, block = _scheme(qc, where)
    by_name = {t.name: t for t in tensors}
    made: dict[str, QuantizedWeight] = {}
    for t in tensors:
        if not t.dtype.startswith("F8_"):
            continue
        if t.dtype != "F8_E4M3":
            raise PrequantError(f"tensor {quote(t.name)} is {t.dtype}; prequant reads FP8 weights stored as float8 "
                                "e4m3 (F8_E4M3) only: convert the original 16-bit checkpoint", where=t.file.name)
        scale = by_name.get(t.name.removesuffix("weight") + SCALE[method]) if t.name.endswith(".weight") else None
        if scale is None:
            raise missing("float8", t, SCALE[method])
        _check_scale(t, scale, method, block)
        made[t.name] = QuantizedWeight(t.name, model_dtype, t.shape, t.file, BIN_OFFSET,
                                       math.prod(t.shape) * ITEMSIZE[model_dtype], t, scale, method, block)
    return made


def describe(ref: QuantizedWeight) -> str:
    """The format of `ref`, for the model card."""
    return "block-scaled FP8 ({}x{} blocks)".format(*ref.block) if ref.block else "compressed-tensors FP8"


def dequantize(ref: QuantizedWeight, weight: torch.Tensor, scale: torch.Tensor,
               each: Each | None = None) -> torch.Tensor:
    """The 16-bit tensor of `ref` from its float8 `weight` and `scale` (as stored), on the weight's device: the product
    in float32, rounded to a 16-bit compressed-tensors scale's dtype (as compressed-tensors computes), then to the
    model's dtype. IEEE float32 products and round-to-nearest-even casts: the same bytes on any device. A table of
    256 products per scale (`lookup`); `each` runs the pieces of rows (`lookup.lookup`)."""
    import torch

    from .dtypes import SAFETENSORS_DTYPES

    device, (rows, cols) = weight.device, ref.shape
    values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().to(device)  # every code's value
    table = scale.reshape(-1, 1).float() * values  # [scales, 256]: one table per scale, in the scale's order
    if ref.method == CT and scale.dtype != torch.float32:
        table = table.to(scale.dtype)
    table = table.to(SAFETENSORS_DTYPES[ref.dtype]).reshape(-1)
    block = ref.block or ((1, cols) if scale.numel() > 1 else None)  # compressed-tensors: per channel or per tensor
    codes = weight.view(torch.uint8)
    return lookup.lookup(table, (rows, cols), lambda a, b: codes[a:b].to(torch.int32),
                         lookup.starts(rows, cols, block, 256, device), each)


def _scheme(qc: dict, where: object) -> tuple[str, tuple[int, int] | None]:
    """(method, block) of a declared FP8 quantization_config; refused where prequant cannot read it."""
    if qc["quant_method"] == CT:
        return CT, None
    size = qc.get("weight_block_size")
    if not (isinstance(size, list) and len(size) == 2 and all(isinstance(n, int) and n > 0 for n in size)):
        raise PrequantError(f"quantization_config's weight_block_size is {size!r}; prequant reads block-scaled FP8 "
                            "(two positive integers, e.g. [128, 128]) only: convert the original 16-bit checkpoint",
                            where=where)
    if qc.get("fmt", "e4m3") != "e4m3":
        raise PrequantError(f"quantization_config's fmt is {qc['fmt']!r}; prequant reads float8 e4m3 weights only: "
                            "convert the original 16-bit checkpoint", where=where)
    return BLOCK, (size[0], size[1])


def _check_scale(w: TensorRef, s: TensorRef, method: str, block: tuple[int, int] | None) -> None:
    """Refuse a scale whose dtype or shape is not the format's for weight `w`."""
    if len(w.shape) != 2:
        raise PrequantError(f"float8 tensor {quote(w.name)} has shape {list(w.shape)}; prequant reads 2-D FP8 weights "
                            "only: convert the original 16-bit checkpoint", where=w.file.name)
    rows, cols = w.shape
    if method == BLOCK:
        assert block is not None
        wanted: tuple[tuple[int, ...], ...] = ((-(-rows // block[0]), -(-cols // block[1])),)
        layout = f"one per {block[0]}x{block[1]} block"
    else:
        wanted = ((1,), (), (rows, 1))
        layout = "per tensor (1,) or per output channel [rows, 1]"
    if s.dtype not in SCALE_DTYPES:
        raise PrequantError(f"scale {quote(s.name)} is {s.dtype}; prequant reads F32, BF16 or F16 FP8 scales only: "
                            "convert the original 16-bit checkpoint", where=s.file.name)
    if tuple(s.shape) not in wanted:
        raise PrequantError(
            f"scale {quote(s.name)} has shape {list(s.shape)}, but {quote(w.name)} {list(w.shape)} takes "
            f"{' or '.join(str(list(x)) for x in wanted)} ({layout}); the checkpoint is damaged or of a layout "
            "prequant does not read: re-download it, or convert the original 16-bit checkpoint", where=s.file.name)
