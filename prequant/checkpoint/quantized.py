"""Quantized checkpoints read as 16-bit ones: each quantized weight dequantized with its companion tensors, on the
device that uses it.

config.json's `quantization_config` declares the format; one module per on-disk format knows it (what it stores, how
its tensors are checked and dequantized):

- `fp8`: block-scaled FP8 (`quant_method: "fp8"`) and compressed-tensors FP8 (`format: "float-quantized"`);
- `int4`: compressed-tensors INT4 (`format: "pack-quantized"`; Kimi-K2);
- `mxfp4`: MXFP4 (`quant_method: "mxfp4"`; gpt-oss's fused experts).

This module is the one place that groups a weight with its companions: each format's `group` turns its stored tensors
into `QuantizedWeight`s (a TensorRef of the model's dtype and the 16-bit tensor's shape, with no byte range of its own:
BIN_OFFSET), and the activation parameters of a quantized module (`input_scale` and the like) ride along with its
weight, dropped. Every weight is dequantized as its format's reference does: the product in float32, rounded once to
the model's dtype (through a 16-bit scale's dtype where the reference computes in it). The conversion's pipeline moves
the stored tensors to the quantizing device and calls `dequantize` there; other readers get the 16-bit tensor on the
CPU through `TensorReader.view`. Companion tensors never reach the plan or the output.

Standard library only at import: `hf_files` (read before torch is imported) asks `declared`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ..errors import PrequantError
from . import fp8, int4, mxfp4
from .lookup import Each
from .tensors import QuantizedWeight, TensorRef, quote

if TYPE_CHECKING:
    import torch

FORMATS = (fp8, int4, mxfp4)
# Activation parameters of a quantized module: what a quantized runtime scales its inputs, outputs and KV cache with.
# Meaningless for a 16-bit or 4-bit model: dropped.
ACTIVATION = ("input_scale", "input_zero_point", "output_scale", "output_zero_point", "activation_scale", "k_scale",
              "v_scale", "q_scale", "input_global_scale")
READ = "fp8 (block-scaled), mxfp4, compressed-tensors float-quantized (FP8) and pack-quantized (INT4)"
_MODEL_DTYPES = {"float16": "F16", "bfloat16": "BF16", "float32": "F32"}


def declared(qc: Any) -> bool:
    """Whether a `quantization_config` declares one of the formats read here (then the source is converted, its
    weights dequantized; any other quantization is refused, named)."""
    return _format(qc) is not None


def described(qc: Any) -> str:
    """A `quantization_config`'s format for a message: its quant_method, and its format where it has one."""
    if not isinstance(qc, dict):
        return "?"
    method, form = qc.get("quant_method", "?"), qc.get("format")
    return f"{method}, format {form}" if isinstance(form, str) else str(method)


def as_16bit(tensors: list[TensorRef], config: dict, where: object = "config.json") -> tuple[list[TensorRef], dict]:
    """The source as the 16-bit checkpoint its quantization declaration stands for: each quantized weight a
    `QuantizedWeight` with its companions and its module's activation parameters folded into it, and config.json
    without the `quantization_config`. A source without one comes back as it is. Refuses, naming the tensor, what the
    format's reference could not dequantize."""
    qc = config.get("quantization_config")
    form = _format(qc)
    if form is None:
        return tensors, config
    made = form.group(tensors, qc, _model_dtype(config, where), where)  # by the name of the stored tensor it replaces
    if not made:
        raise PrequantError(f"config.json declares {form.NAME} weights but {form.NONE}; remove its "
                            "quantization_config if the weights are 16-bit", where=where)
    folded = {piece.name for ref in made.values() for piece in (ref.scale, *ref.checked, *ref.extra)}
    owners = {ref.name: stored for stored, ref in made.items()}  # a weight's name -> its stored tensor's
    riders: dict[str, list[TensorRef]] = {}
    last: str | None = None  # the quantized weight before, in file order: what a parameter of no such module goes with
    for t in tensors:
        module, _, leaf = t.name.rpartition(".")
        if t.name in made:
            last = t.name
        elif t.name in folded:
            continue
        elif leaf in ACTIVATION:
            owner = owners.get(module + ".weight") or last or next(iter(made))
            riders.setdefault(owner, []).append(t)
            folded.add(t.name)
        elif t.dtype.startswith("F8_") or _companion(t.name):
            raise PrequantError(
                f"tensor {quote(t.name)} ({t.dtype}) is not a part of {form.NAME} weights that prequant can read "
                f"({form.PARTS}, activation parameters aside), and config.json declares no other format; the "
                "checkpoint is damaged, mixes formats or is of a layout prequant does not read: re-download it, or "
                "convert the original 16-bit checkpoint", where=t.file.name)
    out: list[TensorRef] = []
    for t in tensors:
        if t.name in made:
            out.append(replace(made[t.name], riders=tuple(riders.get(t.name, ()))))
        elif t.name not in folded:
            out.append(t)
    return out, {k: v for k, v in config.items() if k != "quantization_config"}


def stored(tensors: Iterable[TensorRef]) -> list[TensorRef]:
    """The tensors as they are on disk, in reading order: each quantized weight's codes, scale, companions, riders."""
    return [piece for t in tensors for piece in pieces(t)]


def pieces(ref: TensorRef) -> Iterator[TensorRef]:
    """The stored tensors a tensor of the plan is read from (itself, unless a quantized weight)."""
    if isinstance(ref, QuantizedWeight):
        yield from (ref.stored, ref.scale, *ref.checked, *ref.extra, *ref.riders)
    else:
        yield ref


def read_with(ref: QuantizedWeight) -> tuple[TensorRef, ...]:
    """The stored tensors `dequantize` takes, in its order: the codes, the scale, then the format's others."""
    return (ref.stored, ref.scale, *ref.extra)


def check_stored(ref: QuantizedWeight, view: Callable[[TensorRef], torch.Tensor]) -> None:
    """Refuses `ref` where a stored tensor read on the CPU only (`QuantizedWeight.checked`: INT4's shape) disagrees
    with it; `view` gives a stored tensor as a CPU view. Called before its other stored tensors are read."""
    if ref.checked:
        _by_method(ref.method).check(ref, *(view(t) for t in ref.checked))


def dequantize(ref: QuantizedWeight, *parts: torch.Tensor, each: Each | None = None) -> torch.Tensor:
    """The 16-bit tensor of `ref` from its stored tensors (`read_with`, as stored), on their device, as its format's
    reference computes it. `each(count, work)` runs `work(i)` for every piece of rows i (default: one after the
    other; the pipeline passes its CPU threads)."""
    return _by_method(ref.method).dequantize(ref, *parts, each=each)


def card_note(tensors: Iterable[TensorRef]) -> str | None:
    """The model card's sentence on a quantized source, None for another."""
    found = {_by_method(t.method).describe(t) for t in tensors if isinstance(t, QuantizedWeight)}
    if not found:
        return None
    return (f"The source stores its weights in {' and '.join(sorted(found))}: each one was dequantized as the "
            "format's reference does (in float32, rounded once to the model's dtype), then quantized to 4-bit.")


def reading(data: Any, tensors: Iterable[TensorRef]) -> Any:
    """`data` (a Hub source's reader of the stored tensors) for a plan of `tensors`: wrapped in `Reading` when a
    quantized weight is among them."""
    return Reading(data) if any(isinstance(t, QuantizedWeight) for t in tensors) else data


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


def _companion(name: str) -> bool:
    """Whether a tensor's name is that of a part of a quantized weight in some format read here (`P.weight_*`,
    MXFP4's `X_blocks` and `X_scales`): left over once the declared format's weights are grouped, it is refused."""
    return name.rpartition(".")[2].startswith("weight_") or name.endswith(("_blocks", "_scales"))


def _format(qc: Any) -> Any:
    """The format module declared by a `quantization_config`, None if none read here is."""
    return next((form for form in FORMATS if isinstance(qc, dict) and form.declares(qc)), None)


def _by_method(method: str) -> Any:
    return next(form for form in FORMATS if method in form.METHODS)


def _model_dtype(config: dict, where: object) -> str:
    """The dtype quantized weights dequantize to: the model's, as config.json names it."""
    named = config.get("dtype") or config.get("torch_dtype")
    code = _MODEL_DTYPES.get(named.removeprefix("torch.")) if isinstance(named, str) else None
    if code is None:
        raise PrequantError(f"config.json's dtype is {named!r}: the dtype quantized weights dequantize to is unknown; "
                            'set "torch_dtype" to the model\'s ("bfloat16", "float16" or "float32")', where=where)
    return code
