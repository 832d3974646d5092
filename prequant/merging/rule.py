"""The merge of one tensor, on the pipeline's device: the rule, and the 4-bit base's W.

    W' = W + (B @ A) * scaling        float32: the product, then the scaling, then the sum; rounded once
    embeddings: the delta is (B @ A).T * scaling; GPT-2 Conv1D (fan_in_fan_out, W stored [in, out]): (B @ A).T
    DoRA: W' = (m / ||W + dW||) * (W + dW), the norm over each output's row, float32, rounded once
    LoRA on fused experts: B @ A is expert e's (its rows of A, its columns of B), restricted to W's rows

That is peft's `merge_and_unload` for Linear layers with the adapter in float32 (peft's default); peft rounds an
embedding's delta and a fused experts parameter's to the weight's dtype before adding them, and with `safe_merge`
the sum before DoRA: prequant rounds once (docs/merge.md). Into a 4-bit base, W is what bitsandbytes' CUDA kernel
dequantizes (code times block scale in float32, rounded once to the quant state's dtype): that kernel itself on a
GPU (`bnb.cuda`, called as bitsandbytes' `dequantize_4bit` calls it), prequant's reproduction of it on the CPU
(`bnb.stats.dequantize`; bitsandbytes' CPU path differs for rows that are not a whole number of blocks). Products
are float32 with TF32 off on a GPU (`float32_products`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from ..bnb import cuda
from ..bnb.format import NESTED_BLOCKSIZE, entry_name
from ..bnb.stats import dequantize, dequantize_absmax
from ..checkpoint.dtypes import SAFETENSORS_DTYPES
from ..checkpoint.reader import TensorReader
from ..checkpoint.tensors import TensorRef, quote
from ..errors import PrequantError
from ..util import trace
from .adapter import Target


@dataclass(frozen=True)
class FourBit:
    """A 4-bit base weight: its packed codes' key, its companion tensors (by short name: absmax, quant_map, ...,
    and the quant state's key) and the state they hold."""

    key: str
    companions: dict[str, TensorRef]
    state: dict

    @property
    def dtype(self) -> str:
        """The safetensors code of the dtype it dequantizes to."""
        return {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}[self.state["dtype"]]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.state["shape"])


def four_bit_weights(tensors: list[TensorRef], states: dict[str, dict]) -> dict[str, FourBit]:
    """The 4-bit weights of a bitsandbytes checkpoint, by their packed codes' key: `states`, each one's quant state
    as verify's check parsed it (`check_quantized`, which also found its companions), with its companion tensors."""
    by_name = {t.name: t for t in tensors}
    return {key: FourBit(key, {entry_name(key, n): by_name[n] for n in by_name if n.startswith(key + ".")}, state)
            for key, state in states.items()}


def dequantized(packed: torch.Tensor, weight: FourBit, data: TensorReader) -> torch.Tensor:
    """The 16-bit W bitsandbytes' CUDA kernel gives for `packed` (on its device), in the quant state's dtype."""
    device, s = packed.device, weight.state
    # The quant state's JSON stays on the host, where bitsandbytes reads it.
    parts = {name: data.view(ref) if name.startswith("quant_state") else data.view(ref).to(device)
             for name, ref in weight.companions.items()}
    codes = packed.reshape(-1).view(torch.uint8)
    absmax = dequantize_absmax(parts["absmax"], parts.get("nested_absmax"), parts.get("nested_quant_map"),
                               s.get("nested_offset", 0.0), s.get("nested_blocksize", NESTED_BLOCKSIZE))
    if device.type == "cuda":  # bitsandbytes' `dequantize_4bit` of the `QuantState` its `from_dict` makes of these
        flat = cuda.dequantize_4bit(codes, absmax, s["blocksize"], s["quant_type"],
                                    SAFETENSORS_DTYPES[weight.dtype], math.prod(s["shape"]))
        return flat.view(weight.shape)
    flat = dequantize(codes, absmax, parts["quant_map"], s["blocksize"], math.prod(s["shape"]))
    return flat.to(SAFETENSORS_DTYPES[weight.dtype]).view(weight.shape)


def merged(w: torch.Tensor, target: Target, adapter: TensorReader) -> torch.Tensor:
    """W' for `target` from W (`w`, as stored, on the pipeline's device), in W's dtype."""
    dtype, device = w.dtype, w.device

    def read(ref: TensorRef, index: Any = ()) -> torch.Tensor:
        return adapter.view(ref)[index].to(device)  # indexed on the host: only the rows merged here move

    if target.replace is not None:  # modules_to_save: the trained copy, loaded in the model's dtype
        return _same_shape(read(target.replace), w, target.replace).to(dtype)
    if target.base is not None:  # a saved embedding layer: what peft loads into the model before merging
        w = _same_shape(read(target.base), w, target.base).to(dtype)
    with trace.busy("merge"):
        a: Any = ()
        b: Any = ()
        if target.expert is not None:  # expert e's rank rows of A, its columns of B (rank-major: every E-th)
            e, count = target.expert
            r = target.a.shape[0] // count
            a, b = slice(e * r, (e + 1) * r), (target.rows, slice(e, None, count))
        delta = read(target.b, b).float() @ read(target.a, a).float()
        if target.embedding or target.fan_in_fan_out:
            delta = delta.T
        x = _same_shape(delta.mul_(target.scaling), w, target.a).add(w.float())
        if target.magnitude is not None:
            # One row per output; laid out as peft lays it out, since the norm's summation order follows the layout.
            rows = w.T + delta.T if target.fan_in_fan_out else x
            factor = read(target.magnitude).float() / torch.linalg.norm(rows, dim=1)
            x = x * (factor.view(1, -1) if target.fan_in_fan_out else factor.view(-1, 1))
        return x.to(dtype)


def _same_shape(t: torch.Tensor, w: torch.Tensor, ref: TensorRef) -> torch.Tensor:
    if tuple(t.shape) != tuple(w.shape):
        raise PrequantError(f"adapter tensor {quote(ref.name)} gives shape {tuple(t.shape)} but the base tensor is "
                            f"{tuple(w.shape)}; the adapter was trained on another model (or a resized vocabulary)")
    return t


@contextmanager
def float32_products(device_type: str) -> Iterator[None]:
    """Float32 matrix products in full precision on a GPU (TF32 off) for the span of a merge (`device_type`: the
    pipeline's, 'cuda' or 'cpu'; the flag needs no started device)."""
    if device_type != "cuda":
        yield
        return
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
