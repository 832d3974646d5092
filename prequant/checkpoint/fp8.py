"""FP8 checkpoints read as 16-bit ones: each float8 weight dequantized with its scales, on the device that uses it.

Two on-disk formats, declared by config.json's `quantization_config`:

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

An FP8 weight becomes an `Fp8Weight`: a TensorRef of the model's dtype (config.json's `dtype` or `torch_dtype`) and
the weight's shape, with no byte range of its own (BIN_OFFSET). The conversion's pipeline moves its stored tensors to
the quantizing device and calls `dequantize` there; other readers get it dequantized on the CPU through
`TensorReader.view`. It carries the stored tensors it is made of: the float8 weight, its scale (possibly in another
shard) and the activation parameters of its module (`input_scale` and the like), which the conversion drops. Scales
and activation parameters never reach the plan or the output.

Standard library only at import: `hf_files` (read before torch is imported) asks `declared`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from ..errors import PrequantError
from .tensors import BIN_OFFSET, TensorRef, quote

if TYPE_CHECKING:
    import torch

BLOCK = "fp8"  # transformers' and DeepSeek's block-scaled format
CT = "compressed-tensors"
SCALE = {BLOCK: "weight_scale_inv", CT: "weight_scale"}  # P.weight's scale is P.<this>
# Activation parameters of a quantized module: what an FP8 runtime scales its inputs, outputs and KV cache with.
# Meaningless for a 16-bit or 4-bit model: dropped.
ACTIVATION = ("input_scale", "input_zero_point", "output_scale", "output_zero_point", "activation_scale", "k_scale",
              "v_scale", "q_scale", "input_global_scale")
_MODEL_DTYPES = {"float16": "F16", "bfloat16": "BF16", "float32": "F32"}
_SCALE_DTYPES = ("F32", "BF16", "F16")
# Elements dequantized at a time, whatever the weight size: on a CPU a piece's int32 indices stay in a core's cache;
# on a GPU a piece is large enough that kernel launches cost nothing beside it.
_CPU_PIECE = 1 << 18
_CUDA_PIECE = 1 << 24
Each = Callable[[int, Callable[[int], None]], None]  # each(count, work): work(i) for i in range(count)


@dataclass(frozen=True)
class Fp8Weight(TensorRef):
    """A float8 weight as the 16-bit tensor it dequantizes to (`dtype`: the model's; `nbytes`: at that dtype)."""

    stored: TensorRef  # the float8 weight
    scale: TensorRef
    method: str  # BLOCK or CT
    block: tuple[int, int] | None  # BLOCK: rows and columns per scale
    riders: tuple[TensorRef, ...] = ()  # activation parameters dropped with it


def declared(qc: Any) -> bool:
    """Whether a `quantization_config` declares one of the FP8 formats read here (then the source is converted, its
    weights dequantized; any other quantization is refused as already quantized)."""
    return isinstance(qc, dict) and (qc.get("quant_method") == BLOCK or (
        qc.get("quant_method") == CT and qc.get("format") == "float-quantized"))


def as_16bit(tensors: list[TensorRef], config: dict, where: object = "config.json") -> tuple[list[TensorRef], dict]:
    """The source as the 16-bit checkpoint its FP8 declaration stands for: each float8 weight an `Fp8Weight`, its scale
    and its module's activation parameters folded into it, and config.json without the FP8 `quantization_config`.
    A source without one comes back as it is. Refuses, naming the tensor, what the reference could not dequantize."""
    qc = config.get("quantization_config")
    if not declared(qc):
        return tensors, config
    method, block = _scheme(qc, where)
    model_dtype = _model_dtype(config, where)
    by_name = {t.name: t for t in tensors}
    made: dict[str, Fp8Weight] = {}  # by the weight's name
    folded: set[str] = set()
    for t in tensors:
        if not t.dtype.startswith("F8_"):
            continue
        if t.dtype != "F8_E4M3":
            raise PrequantError(f"tensor {quote(t.name)} is {t.dtype}; prequant reads FP8 weights stored as float8 "
                                "e4m3 (F8_E4M3) only: convert the original 16-bit checkpoint", where=t.file.name)
        scale = by_name.get(t.name.removesuffix("weight") + SCALE[method]) if t.name.endswith(".weight") else None
        if scale is None:
            raise PrequantError(
                f"float8 tensor {quote(t.name)} has no {SCALE[method]} beside it, and without its scales its values "
                f"mean nothing; restore the missing tensor (or the shard holding it) and rerun", where=t.file.name)
        _check_scale(t, scale, method, block)
        made[t.name] = Fp8Weight(t.name, model_dtype, t.shape, t.file, BIN_OFFSET,
                                 math.prod(t.shape) * _itemsize(model_dtype), t, scale, method, block)
        folded.add(scale.name)
    if not made:
        raise PrequantError(f"config.json declares FP8 weights ({method}) but no tensor is float8; remove its "
                            "quantization_config if the weights are 16-bit", where=where)
    riders: dict[str, list[TensorRef]] = {}
    last: str | None = None  # the FP8 weight before, in file order: what a parameter of no FP8 module goes with
    for t in tensors:
        module, _, leaf = t.name.rpartition(".")
        if t.name in made:
            last = t.name
        elif leaf in ACTIVATION:
            owner = module + ".weight" if module + ".weight" in made else (last or next(iter(made)))
            riders.setdefault(owner, []).append(t)
            folded.add(t.name)
        elif t.name not in folded and leaf.startswith("weight_"):
            raise PrequantError(
                f"tensor {quote(t.name)} is not a part of FP8 weights that prequant can read ({method}: "
                f"{SCALE[method]} per weight, activation parameters aside); convert the original 16-bit checkpoint",
                where=t.file.name)
    out: list[TensorRef] = []
    for t in tensors:
        if t.name in made:
            out.append(replace(made[t.name], riders=tuple(riders.get(t.name, ()))))
        elif t.name not in folded:
            out.append(t)
    return out, {k: v for k, v in config.items() if k != "quantization_config"}


def stored(tensors: Iterable[TensorRef]) -> list[TensorRef]:
    """The tensors as they are on disk, in reading order: each FP8 weight's float8 tensor, scale and riders."""
    return [piece for t in tensors for piece in pieces(t)]


def pieces(ref: TensorRef) -> Iterator[TensorRef]:
    """The stored tensors a tensor of the plan is read from (itself, unless an FP8 weight)."""
    if isinstance(ref, Fp8Weight):
        yield ref.stored
        yield ref.scale
        yield from ref.riders
    else:
        yield ref


def card_note(tensors: Iterable[TensorRef]) -> str | None:
    """The model card's sentence on an FP8 source, None for another."""
    found = {(t.method, t.block) for t in tensors if isinstance(t, Fp8Weight)}
    if not found:
        return None
    kinds = sorted("block-scaled FP8 ({}x{} blocks)".format(*block) if method == BLOCK else "compressed-tensors FP8"
                   for method, block in found)
    return (f"The source stores its weights in {' and '.join(kinds)}: each one was dequantized as the reference does "
            "(the product with its scale in float32, rounded once to the model's dtype), then quantized to 4-bit.")


def dequantize(ref: Fp8Weight, weight: torch.Tensor, scale: torch.Tensor, each: Each | None = None) -> torch.Tensor:
    """The 16-bit tensor of `ref` from its float8 `weight` and `scale` (as stored), on the weight's device: the product
    in float32, rounded to a 16-bit compressed-tensors scale's dtype (as compressed-tensors computes), then to the
    model's dtype. IEEE float32 products and round-to-nearest-even casts: the same bytes on any device.

    A float8 code has 256 values and a scale covers a block, a row or the tensor, so every product is an entry of a
    table of 256 per scale, computed once with those operations; the weight is then a lookup in that table
    (`index_select`), several times faster on a CPU than converting each float8 element. `each(count, work)` runs
    `work(i)` for every piece of rows i (default: one after the other; the pipeline passes its CPU threads)."""
    import torch

    from .dtypes import SAFETENSORS_DTYPES

    device, (rows, cols) = weight.device, ref.shape
    out = torch.empty(ref.shape, dtype=SAFETENSORS_DTYPES[ref.dtype], device=device)
    if out.numel() == 0:
        return out
    values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().to(device)  # every code's value
    table = scale.reshape(-1, 1).float() * values  # [scales, 256]: one table per scale, in the scale's order
    if ref.method == CT and scale.dtype != torch.float32:
        table = table.to(scale.dtype)
    table = table.to(out.dtype).reshape(-1)
    # Where each element's table starts: its scale's index times 256 (float8 code added to it below).
    row_start = col_start = None
    if ref.block:
        per_row = -(-cols // ref.block[1])
        row_start = torch.arange(rows, dtype=torch.int32, device=device).div_(ref.block[0], rounding_mode="floor")
        row_start = row_start.mul_(per_row * 256).unsqueeze(1)
        col_start = torch.arange(cols, dtype=torch.int32, device=device).div_(ref.block[1], rounding_mode="floor")
        col_start = col_start.mul_(256)
    elif scale.numel() > 1:  # per output channel
        row_start = torch.arange(rows, dtype=torch.int32, device=device).mul_(256).unsqueeze(1)
    codes, flat = weight.view(torch.uint8), out.view(-1)
    step = max(1, (_CUDA_PIECE if device.type == "cuda" else _CPU_PIECE) // cols)

    def piece(i: int) -> None:
        a, b = i * step, min(rows, (i + 1) * step)
        index = codes[a:b].to(torch.int32)
        if row_start is not None:
            index += row_start[a:b]
        if col_start is not None:
            index += col_start
        torch.index_select(table, 0, index.view(-1), out=flat[a * cols : b * cols])

    (each or _one_by_one)(-(-rows // step), piece)
    return out


def _one_by_one(count: int, work: Callable[[int], None]) -> None:
    for i in range(count):
        work(i)


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


def _model_dtype(config: dict, where: object) -> str:
    """The dtype FP8 weights dequantize to: the model's, as config.json names it."""
    named = config.get("dtype") or config.get("torch_dtype")
    code = _MODEL_DTYPES.get(named.removeprefix("torch.")) if isinstance(named, str) else None
    if code is None:
        raise PrequantError(f"config.json's dtype is {named!r}: the dtype FP8 weights dequantize to is unknown; set "
                            '"torch_dtype" to the model\'s ("bfloat16", "float16" or "float32")', where=where)
    return code


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
    if s.dtype not in _SCALE_DTYPES:
        raise PrequantError(f"scale {quote(s.name)} is {s.dtype}; prequant reads F32, BF16 or F16 FP8 scales only: "
                            "convert the original 16-bit checkpoint", where=s.file.name)
    if tuple(s.shape) not in wanted:
        raise PrequantError(
            f"scale {quote(s.name)} has shape {list(s.shape)}, but {quote(w.name)} {list(w.shape)} takes "
            f"{' or '.join(str(list(x)) for x in wanted)} ({layout}); the checkpoint is damaged or of a layout "
            "prequant does not read: re-download it, or convert the original 16-bit checkpoint", where=s.file.name)


def _itemsize(code: str) -> int:
    return {"F16": 2, "BF16": 2, "F32": 4}[code]


def reading(data: Any, tensors: Iterable[TensorRef]) -> Any:
    """`data` (a Hub source's reader of the stored tensors) for a plan of `tensors`: wrapped in `Reading` when an FP8
    weight is among them."""
    return Reading(data) if any(isinstance(t, Fp8Weight) for t in tensors) else data


class Reading:
    """A source's reader seen from the plan: a tensor done is each of the stored tensors it was read from done (a
    Hub source frees and evicts its shards by them). Everything else is the reader's."""

    def __init__(self, data: Any) -> None:
        self.data = data

    def tensor_done(self, ref: TensorRef) -> None:
        for piece in pieces(ref):
            self.data.tensor_done(piece)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.data, name)

    def __enter__(self) -> Reading:
        self.data.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.data.__exit__(*exc)
