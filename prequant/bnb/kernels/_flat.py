"""A CPU tensor's memory as numpy, read as its row-major flattening one range at a time, never copied whole.

The CPU kernel and the error statistics both work on block-aligned ranges of the flattened tensor in numpy
(single-threaded and releasing the GIL, so the pool's threads overlap; see `_parallel`). numpy has no
bfloat16, so bf16 tensors are seen as their uint16 bit patterns, which are also what the kernel wants
from every dtype (`bits=True`). A contiguous tensor's range is a view; a transposed or strided one (GPT-2
Conv1D weights, quantized transposed) is copied range by range.
"""

from __future__ import annotations

import numpy as np
import torch

_BITS = {2: (torch.int16, np.uint16), 4: (torch.int32, np.uint32), 8: (torch.int64, np.uint64)}


class Flat:
    """Elements [start, stop) of a tensor's row-major flattening, as numpy."""

    def __init__(self, x: torch.Tensor, *, bits: bool = False) -> None:
        x = x.detach()
        if bits or x.dtype == torch.bfloat16:
            as_int, as_uint = _BITS[x.element_size()]
            array = x.view(as_int).numpy().view(as_uint)
        else:
            array = x.numpy()
        self.array = array
        self.flat = array.reshape(-1) if x.is_contiguous() else None  # a view, or None: it would copy
        self.dtype = array.dtype

    def range(self, start: int, stop: int, buf: np.ndarray) -> np.ndarray:
        """The elements [start, stop): a view when the tensor is contiguous, else copied into `buf`."""
        if self.flat is not None:
            return self.flat[start:stop]
        out = buf[: stop - start]
        copy_flat_range(self.array, start, stop, out)
        return out


def float32(values: np.ndarray, torch_dtype: torch.dtype, out: np.ndarray) -> np.ndarray:
    """Some elements as float32 (exactly: every input dtype but float64 converts without rounding): `out`,
    or `values` itself when they already are float32."""
    if torch_dtype == torch.bfloat16:  # the bits, 16 places up
        wide = out.view(np.uint32)
        np.copyto(wide, values)
        np.left_shift(wide, 16, out=wide)
        return out
    if values.dtype == np.float32:
        return values
    np.copyto(out, values, casting="unsafe")
    return out


def copy_flat_range(x: np.ndarray, start: int, stop: int, out: np.ndarray) -> None:
    """Copy elements [start, stop) of x's row-major flattening into out, for any strides.

    Only slices of x are read, so a non-contiguous tensor is never copied whole: whole rows in the
    middle of the range go in one strided copy, partial rows at either end recurse into that row.
    """
    if x.ndim <= 1:
        out[: stop - start] = x.reshape(-1)[start:stop]
        return
    inner = x[0].size
    first, last = start // inner, (stop - 1) // inner
    if first == last:
        copy_flat_range(x[first], start - first * inner, stop - first * inner, out)
        return
    pos = 0
    if start % inner:
        head_end = (first + 1) * inner
        copy_flat_range(x[first], start - first * inner, inner, out)
        pos, first = head_end - start, first + 1
    full_end = last if stop % inner else last + 1
    if full_end > first:
        rows = x[first:full_end]
        out[pos : pos + rows.size].reshape(rows.shape)[...] = rows
        pos += rows.size
    if stop % inner:
        copy_flat_range(x[last], 0, stop - last * inner, out[pos:])
