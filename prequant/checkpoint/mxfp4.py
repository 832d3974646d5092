"""MXFP4 weights (gpt-oss): the format and its dequantization (`quantized` groups and reads them).

Declared by config.json's `quantization_config: {"quant_method": "mxfp4", ...}`. A quantized parameter `X` (gpt-oss:
each MoE block's fused `mlp.experts.gate_up_proj` and `mlp.experts.down_proj`; their biases and every other tensor are
16-bit) stores:

- `X_blocks` uint8 [E, R, G, 16]: 32 FP4 e2m1 codes per row of 16 bytes, two a byte, the low nibble first;
- `X_scales` uint8 [E, R, G]: one e8m0 exponent per 32 values, biased by 127.

transformers' MXFP4 integration with `Mxfp4Config(dequantize=True)` (`integrations/mxfp4.py`,
`convert_moe_packed_tensors`) is the reference: each code's e2m1 value times 2^(scale - 127) (`torch.ldexp`, in
float32 as torch computes it), stored in the model's dtype, the [E, R, G*32] result transposed to [E, G*32, R]: the
parameter `X` as transformers holds gpt-oss's experts (`gate_up_proj [E, H, 2I]`, gate and up interleaved;
`down_proj [E, I, H]`). An `X_blocks` becomes a `QuantizedWeight` named `X`, of that shape, in its place.

Standard library only at import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import PrequantError
from . import lookup
from .lookup import ITEMSIZE, Each
from .tensors import BIN_OFFSET, QuantizedWeight, TensorRef, missing, quote

if TYPE_CHECKING:
    import torch

METHOD = "mxfp4"
METHODS = (METHOD,)
NAME = "MXFP4"
PARTS = "X_blocks uint8 [E, R, G, 16] with X_scales uint8 [E, R, G]"
NONE = "no tensor is an MXFP4 *_blocks"
PER_SCALE = 32  # values sharing one exponent
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)  # by code


def declares(qc: dict) -> bool:
    """Whether a `quantization_config` declares MXFP4."""
    return qc.get("quant_method") == METHOD


def group(tensors: list[TensorRef], qc: dict, model_dtype: str, where: object) -> dict[str, QuantizedWeight]:
    """Each `X_blocks` as a `QuantizedWeight` named `X` (by the name of its blocks) with its scales. MXFP4 has one
    layout: nothing in its `qc` changes how its tensors read."""
    by_name = {t.name: t for t in tensors}
    made: dict[str, QuantizedWeight] = {}
    for t in tensors:
        if not t.name.endswith("_blocks"):
            continue
        name = t.name.removesuffix("_blocks")
        scales = by_name.get(name + "_scales")
        if scales is None:
            raise missing("MXFP4", t, quote(name + "_scales"))
        _check(t, scales)
        experts, rows, groups, _ = t.shape
        shape = (experts, groups * PER_SCALE, rows)
        made[t.name] = QuantizedWeight(name, model_dtype, shape, t.file, BIN_OFFSET,
                                       experts * rows * groups * PER_SCALE * ITEMSIZE[model_dtype], t, scales,
                                       METHOD, None)
    return made


def describe(ref: QuantizedWeight) -> str:
    """The format of `ref`, for the model card."""
    return "MXFP4 (FP4 e2m1 codes, an e8m0 scale per 32 values)"


def dequantize(ref: QuantizedWeight, blocks: torch.Tensor, scales: torch.Tensor,
               each: Each | None = None) -> torch.Tensor:
    """The 16-bit tensor of `ref` from its stored `blocks` and `scales`, on their device: each code's value times
    2^(scale - 127) in float32, rounded to the model's dtype, transposed as transformers holds it. A table of 16 values
    per exponent (`lookup`); `each` runs the pieces of rows (`lookup.lookup`)."""
    import torch

    from .dtypes import SAFETENSORS_DTYPES

    device = blocks.device
    experts, rows, groups, width = blocks.shape
    cols = groups * width * 2
    values = torch.tensor(E2M1, dtype=torch.float32, device=device)
    exponents = torch.arange(256, dtype=torch.int32, device=device) - 127
    # [256 exponents, 16 codes], by torch.ldexp as the reference (its operands full-size: it resizes no output)
    table = torch.ldexp(values.expand(256, 16).contiguous(), exponents.unsqueeze(1).expand(256, 16).contiguous())
    table = table.to(SAFETENSORS_DTYPES[ref.dtype]).reshape(-1)
    out = torch.empty((experts, cols, rows), dtype=table.dtype, device=device)  # as transformers holds it
    for e in range(experts):  # each expert's [rows, cols] written transposed into its place: no full-size copy
        codes, exps = blocks[e].reshape(rows, groups * width), scales[e]

        def index(a: int, b: int, codes: torch.Tensor = codes, exps: torch.Tensor = exps) -> torch.Tensor:
            at = lookup.nibbles(codes[a:b], cols)
            at.view(b - a, groups, PER_SCALE).add_(exps[a:b].to(torch.int32).mul_(16).unsqueeze(-1))
            return at

        lookup.lookup(table, (rows, cols), index, each=each, out=out[e].t())
    return out


def _check(blocks: TensorRef, scales: TensorRef) -> None:
    """Refuse blocks or scales whose dtype or shape is not the format's, naming the tensor."""
    fix = "the checkpoint is damaged or of a layout prequant does not read: re-download it, or convert the original " \
          "16-bit checkpoint"
    if blocks.dtype != "U8" or len(blocks.shape) != 4 or blocks.shape[-1] != PER_SCALE // 2:
        raise PrequantError(
            f"MXFP4 blocks {quote(blocks.name)} are {blocks.dtype} {list(blocks.shape)}; prequant reads uint8 "
            f"[experts, rows, groups, {PER_SCALE // 2}] (16 bytes, 32 FP4 codes, a scale): {fix}",
            where=blocks.file.name)
    if scales.dtype != "U8" or tuple(scales.shape) != tuple(blocks.shape[:-1]):
        raise PrequantError(
            f"MXFP4 scales {quote(scales.name)} are {scales.dtype} {list(scales.shape)}, but {quote(blocks.name)} "
            f"{list(blocks.shape)} takes uint8 {list(blocks.shape[:-1])} (one e8m0 exponent per {PER_SCALE} values); "
            f"{fix}", where=scales.file.name)
