"""INT4 pack-quantized compressed-tensors weights (Kimi-K2-Thinking): the format and its dequantization (`quantized`
groups and reads them).

Declared by config.json's `quantization_config`: `quant_method: "compressed-tensors"`, `format: "pack-quantized"`,
and `config_groups` whose `weights` say `num_bits: 4`, `type: "int"`, the `strategy` (`group` with its `group_size`,
`channel` or `tensor`) and `symmetric`. Modules in `ignore` are stored 16-bit. A quantized module `P` stores:

- `P.weight_packed` int32 [rows, ceil(cols/8)]: eight 4-bit codes a word, element i in bits 4i..4i+3 (on disk, byte j
  holds elements 2j in its low nibble and 2j+1 in its high one), each code the integer plus 8;
- `P.weight_scale` (bf16, fp16 or fp32): [rows, cols/group_size] per group, [rows, 1] per channel, (1,) per tensor;
- `P.weight_shape` int [2]: the weight's [rows, cols];
- asymmetric only: `P.weight_zero_point` int32 [ceil(rows/8), groups], the zero points packed the same way down
  the rows.

compressed-tensors' `PackedQuantizationCompressor.decompress` is the reference: unpack (`unpack_from_int32`), then
`dequantize`: `(x_q.to(scale.dtype) - zero_point.to(scale.dtype)) * scale` in the scale's dtype, then the model's
dtype on load. The codes and zero points are integers below 16 in magnitude, exact in any float dtype, so that is the
FP8 rule: the product in float32, rounded to a 16-bit scale's dtype, then to the model's. A weight becomes a
`QuantizedWeight` named `P.weight`, in the place of its `weight_packed`; the experts of a DeepSeek-V3-architecture
model are 2-D per expert, so they are weights like any other.

Standard library only at import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import PrequantError
from . import lookup
from .fp8 import CT, SCALE_DTYPES
from .lookup import ITEMSIZE, Each
from .tensors import BIN_OFFSET, QuantizedWeight, TensorRef, missing, quote

if TYPE_CHECKING:
    import torch

FORMAT = "pack-quantized"
METHOD = "compressed-tensors-int4"
METHODS = (METHOD,)
NAME = "compressed-tensors INT4 (pack-quantized)"
PARTS = "weight_packed, weight_scale, weight_shape and, asymmetric, weight_zero_point per weight"
NONE = "no tensor is a weight_packed"
STRATEGIES = ("group", "channel", "tensor")
_SHAPE_DTYPES = ("I64", "I32")


@dataclass(frozen=True)
class Scheme:
    strategy: str  # one of STRATEGIES
    group_size: int | None  # the group strategy's
    symmetric: bool


def declares(qc: dict) -> bool:
    """Whether a `quantization_config` declares compressed-tensors' pack-quantized format."""
    return qc.get("quant_method") == CT and qc.get("format") == FORMAT


def _scheme(qc: dict, where: object) -> Scheme:
    """The weights' scheme of a pack-quantized `quantization_config`, one for every config group; refused (naming
    the field) where prequant cannot read it."""
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise PrequantError("quantization_config has no config_groups, so the INT4 weights' scheme is unknown; "
                            "restore config.json as published", where=where)
    found: set[Scheme] = set()
    for name, g in groups.items():
        w = g.get("weights") if isinstance(g, dict) else None
        if not isinstance(w, dict):
            raise PrequantError(f"config_groups.{name} has no weights scheme; restore config.json as published",
                                where=where)
        form = g.get("format") or FORMAT
        bits, kind, strategy, size = w.get("num_bits"), w.get("type"), w.get("strategy"), w.get("group_size")
        if form != FORMAT or bits != 4 or kind != "int" or strategy not in STRATEGIES or (
                strategy == "group" and not (isinstance(size, int) and size > 0 and size % 2 == 0)):
            raise PrequantError(
                f"config_groups.{name} declares weights of format {form!r}, num_bits {bits!r}, type {kind!r}, "
                f"strategy {strategy!r}, group_size {size!r}; prequant reads pack-quantized 4-bit int weights per "
                f"group (an even group_size), channel or tensor: convert the original 16-bit checkpoint", where=where)
        symmetric = w.get("symmetric", True) is not False
        if not symmetric and strategy == "tensor":
            raise PrequantError(f"config_groups.{name} declares asymmetric per-tensor INT4 weights, which prequant "
                                "does not read (per group or channel only): convert the original 16-bit checkpoint",
                                where=where)
        found.add(Scheme(strategy, size if strategy == "group" else None, symmetric))
    if len(found) > 1:
        raise PrequantError(f"quantization_config's config_groups declare {len(found)} different INT4 weight schemes; "
                            "prequant reads one for the whole checkpoint: convert the original 16-bit checkpoint",
                            where=where)
    return found.pop()


def group(tensors: list[TensorRef], qc: dict, model_dtype: str, where: object) -> dict[str, QuantizedWeight]:
    """Each `P.weight_packed` as a `QuantizedWeight` named `P.weight` (by the name of its `weight_packed`), with its
    scale, shape and zero point, in the scheme `qc` declares."""
    scheme = _scheme(qc, where)
    by_name = {t.name: t for t in tensors}
    made: dict[str, QuantizedWeight] = {}
    for t in tensors:
        if not t.name.endswith(".weight_packed"):
            continue
        module = t.name.removesuffix(".weight_packed")
        parts = ["weight_scale", "weight_shape"] + ([] if scheme.symmetric else ["weight_zero_point"])
        found = {}
        for part in parts:
            found[part] = by_name.get(f"{module}.{part}")
            if found[part] is None:
                raise missing("INT4", t, part)
        shape = _check(t, found["weight_scale"], found["weight_shape"], found.get("weight_zero_point"), scheme)
        block = {"group": (1, scheme.group_size), "channel": (1, shape[1]), "tensor": None}[scheme.strategy]
        extra = () if scheme.symmetric else (found["weight_zero_point"],)
        made[t.name] = QuantizedWeight(f"{module}.weight", model_dtype, shape, t.file, BIN_OFFSET,
                                       shape[0] * shape[1] * ITEMSIZE[model_dtype], t, found["weight_scale"], METHOD,
                                       block, extra, (found["weight_shape"],))
    return made


def describe(ref: QuantizedWeight) -> str:
    """The format of `ref`, for the model card."""
    per = (f"groups of {ref.block[1]}" if ref.block and ref.block[1] != ref.shape[1] else
           "per channel" if ref.block else "per tensor")
    return f"compressed-tensors INT4 pack-quantized ({per}{', asymmetric' if ref.extra else ''})"


def check(ref: QuantizedWeight, shape: torch.Tensor) -> None:
    """Refuses `ref` where its stored `weight_shape` (a CPU view) is not the [rows, cols] its codes and scale make."""
    rows, cols = ref.shape
    if shape.tolist() != [rows, cols]:
        raise PrequantError(
            f"tensor {quote(ref.checked[0].name)} holds {shape.tolist()}, but its weight_packed and weight_scale make "
            f"a [{rows}, {cols}] weight (prequant reads widths that are a multiple of 8 per channel or tensor); the "
            "checkpoint is damaged or of a layout prequant does not read: re-download it, or convert the original "
            "16-bit checkpoint", where=ref.stored.file.name)


def dequantize(ref: QuantizedWeight, packed: torch.Tensor, scale: torch.Tensor,
               zero_point: torch.Tensor | None = None, each: Each | None = None) -> torch.Tensor:
    """The 16-bit tensor of `ref` from its stored `weight_packed`, `weight_scale` and zero point, on the codes'
    device (its `weight_shape` is `check`ed before): `(code - zero point) * scale` in float32, rounded to a 16-bit
    scale's dtype, then to the model's. A table of 16 values per scale (`lookup`); `each` runs the pieces of rows
    (`lookup.lookup`)."""
    import torch

    from .dtypes import SAFETENSORS_DTYPES

    rows, cols = ref.shape
    device = packed.device
    codes = torch.arange(16, dtype=torch.float32, device=device)
    if zero_point is None:
        offsets = torch.full((1, 1), 8.0, device=device)  # the codes are the integers plus 8
    else:  # packed down the rows: unpack [groups, rows], as stored transposed
        per_group = lookup.nibbles(zero_point.t().contiguous().view(torch.uint8), rows)
        offsets = per_group.t().reshape(-1, 1).float()
    table = (codes - offsets) * scale.reshape(-1, 1).float()  # [scales, 16], in the scale's order
    if scale.dtype != torch.float32:
        table = table.to(scale.dtype)
    table = table.to(SAFETENSORS_DTYPES[ref.dtype]).reshape(-1)
    data = packed.view(torch.uint8)
    return lookup.lookup(table, (rows, cols), lambda a, b: lookup.nibbles(data[a:b], cols),
                         lookup.starts(rows, cols, ref.block, 16, device), each)


def _check(w: TensorRef, s: TensorRef, shape: TensorRef, zp: TensorRef | None, scheme: Scheme) -> tuple[int, int]:
    """The [rows, cols] weight that `weight_packed` `w` stands for; refuses a part whose dtype or shape is not the
    format's, naming it."""
    fix = "the checkpoint is damaged or of a layout prequant does not read: re-download it, or convert the original " \
          "16-bit checkpoint"
    if w.dtype != "I32" or len(w.shape) != 2:
        raise PrequantError(f"tensor {quote(w.name)} is {w.dtype} {list(w.shape)}; pack-quantized INT4 codes are "
                            f"int32 [rows, cols/8]: {fix}", where=w.file.name)
    rows, words = w.shape
    if s.dtype not in SCALE_DTYPES:
        raise PrequantError(f"scale {quote(s.name)} is {s.dtype}; prequant reads F32, BF16 or F16 INT4 scales only: "
                            "convert the original 16-bit checkpoint", where=s.file.name)
    if scheme.strategy == "group":
        assert scheme.group_size is not None
        groups = s.shape[1] if len(s.shape) == 2 else 0
        cols = groups * scheme.group_size
        wanted: tuple[tuple[int, ...], ...] = ((rows, -(-words * 8 // scheme.group_size)),)
        ok = len(s.shape) == 2 and s.shape[0] == rows and -(-cols // 8) == words
        layout = f"one per group of {scheme.group_size}"
        if not ok and tuple(s.shape) in wanted:  # the scale is what the codes take, but its groups want other codes
            raise PrequantError(
                f"tensor {quote(w.name)} has shape {list(w.shape)}, but its scale {quote(s.name)} {list(s.shape)} "
                f"({layout}) takes int32 {[rows, -(-cols // 8)]}; {fix}", where=w.file.name)
    else:
        cols = words * 8
        wanted = ((rows, 1),) if scheme.strategy == "channel" else ((1,), ())
        ok = tuple(s.shape) in wanted
        layout = "one per output channel" if scheme.strategy == "channel" else "one for the tensor"
    if not ok:
        raise PrequantError(
            f"scale {quote(s.name)} has shape {list(s.shape)}, but {quote(w.name)} {list(w.shape)} takes "
            f"{' or '.join(str(list(x)) for x in wanted)} ({layout}); {fix}", where=s.file.name)
    if shape.dtype not in _SHAPE_DTYPES or tuple(shape.shape) != (2,):
        raise PrequantError(f"tensor {quote(shape.name)} is {shape.dtype} {list(shape.shape)}; a weight_shape is "
                            f"int [2]: {fix}", where=shape.file.name)
    if zp is not None:
        groups = s.shape[1] if len(s.shape) == 2 else 1
        if zp.dtype != "I32" or tuple(zp.shape) != (-(-rows // 8), groups):
            raise PrequantError(
                f"zero point {quote(zp.name)} is {zp.dtype} {list(zp.shape)}, but {quote(w.name)} takes int32 "
                f"{[-(-rows // 8), groups]} (packed down the rows); {fix}", where=zp.file.name)
    return rows, cols
