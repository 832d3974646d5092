"""The error sums of `bnb.stats.compare` on the CPU: dequantize and compare block-aligned ranges on the pool.

On the CPU the statistics cost about half as much as the quantization itself, so they must scale with the
cores too (a conversion's CPU stage is the kernel plus these). Each task dequantizes a range as bitsandbytes
does (one lookup per byte in a table of code pairs, times the block's absmax, in float32) and returns its
partial sums; the partial sums are added in task order, so the result does not depend on the thread count.
"""

from __future__ import annotations

import math
import threading

import numpy as np
import torch

from . import _flat, _parallel

# Elements per task, a multiple of every blocksize, the same for any thread count: the partial sums are
# those of whole tasks, so the figures do not depend on the machine. Large, so that each numpy call
# outlasts the GIL's hand-overs (`_parallel.task_elements`).
TASK_ELEMENTS = 1 << 20


def error_sums(
    source: torch.Tensor,
    codes: torch.Tensor,
    absmax: torch.Tensor,
    pairs: torch.Tensor,
    blocksize: int,
    n: int,
    exponent: int = 0,
) -> tuple[float, float, float]:
    """(sum of squared errors, sum of squared source values, max |error|) over the first n elements, all of
    values scaled by 2**-exponent (exact: only exponents change; `bnb.stats.compare` says why).

    source: the tensor quantized (any float dtype, any strides); codes: uint8, two per byte; absmax: float32
    per block; pairs: float64 [256], each the two float32 values a byte of codes decodes to (as raw bits).
    """
    src = _flat.Flat(source)
    codes_np, absmax_np = codes.numpy(), absmax.float().contiguous().numpy()
    if exponent:  # the decoded values scale with their block's absmax
        factors = _factors(exponent)
        absmax_np = absmax_np * factors[0] * factors[1]
    step = max(blocksize, TASK_ELEMENTS // blocksize * blocksize)
    tasks = -(-n // step)
    partial: list[tuple[float, float, float]] = [(0.0, 0.0, 0.0)] * tasks

    def task(i: int) -> None:
        start, end = i * step, min((i + 1) * step, n)
        raw = src.range(start, end, _scratch(step).raw.view(src.dtype))
        first = start // blocksize
        partial[i] = chunk_sums(raw, source.dtype, codes_np[start // 2 :], absmax_np[first:], pairs, blocksize,
                                exponent)  # fmt: skip

    _parallel.run(tasks, task)
    err2 = math.fsum(p[0] for p in partial)
    ref2 = math.fsum(p[1] for p in partial)
    max_err = max((p[2] for p in partial), default=0.0, key=lambda v: math.inf if math.isnan(v) else v)
    return err2, ref2, max_err


def chunk_sums(raw: np.ndarray, dtype: torch.dtype, codes: np.ndarray, absmax: np.ndarray, pairs: torch.Tensor,
               blocksize: int, exponent: int) -> tuple[float, float, float]:  # fmt: skip
    """The sums of `error_sums` over one block-aligned range: `raw` its source elements (as `_flat.Flat` reads
    a tensor of `dtype`), `codes` and `absmax` (scaled) starting at its first element; one task of the thread
    pool."""
    count = len(raw)
    s = _scratch(count)
    pair_count = (count + 1) // 2
    np.copyto(s.index[:pair_count], codes[:pair_count])
    torch.index_select(pairs, 0, s.index_t[:pair_count], out=s.pairs_t[:pair_count])
    values = s.pairs[:pair_count].view(np.float32)[:count]
    full = count // blocksize
    block_values = values[: full * blocksize].reshape(full, blocksize)
    np.multiply(block_values, absmax[:full, None], out=block_values)
    if full * blocksize < count:  # the tensor's last, partial block
        np.multiply(values[full * blocksize :], absmax[full], out=values[full * blocksize :])
    x = _flat.float32(raw, dtype, s.x[:count])
    if exponent:  # into the scratch buffer: x may be the source's own memory
        factors = _factors(exponent)
        x = np.multiply(x, factors[0], out=s.x[:count])
        np.multiply(x, factors[1], out=x)
    diff = np.subtract(values, x, out=values)
    max_err = float(np.maximum(diff.max(), -diff.min()))  # NaN propagates, as it should
    # einsum's float32 dot product: vectorized, single-threaded (np.dot would call a threaded BLAS), and
    # over one task its rounding stays far below the 6 digits kept; the tasks' sums are added exactly.
    err2 = float(np.einsum("i,i->", diff, diff))
    ref2 = float(np.einsum("i,i->", x, x))
    return err2, ref2, max_err


def _factors(exponent: int) -> tuple[np.float32, np.float32]:
    """2**-exponent as two float32 factors, so that neither overflows (|exponent| <= 149 for finite scales)."""
    half = exponent // 2
    return np.float32(2.0**-half), np.float32(2.0 ** -(exponent - half))


def dequantize_nested(codes: torch.Tensor, nested_absmax: torch.Tensor, nested_map: torch.Tensor, offset: float,
                      nested_blocksize: int) -> torch.Tensor:  # fmt: skip
    """float32 absmax from its double-quantized form, as bitsandbytes computes it:
    ``nested_map[code] * nested_absmax[i // nested_blocksize] + offset``, in float32 (two roundings)."""
    out = torch.empty(codes.numel(), dtype=torch.float32)
    out_np, codes_np = out.numpy(), codes.reshape(-1).numpy()
    table, scales = nested_map.float().numpy(), nested_absmax.float().reshape(-1).numpy()
    shift = np.float32(offset)
    step = max(nested_blocksize, TASK_ELEMENTS // nested_blocksize * nested_blocksize)

    def task(i: int) -> None:
        start = i * step
        part = out_np[start : start + step]
        np.take(table, codes_np[start : start + step], out=part)
        full, first = len(part) // nested_blocksize, start // nested_blocksize
        blocks = part[: full * nested_blocksize].reshape(full, nested_blocksize)
        np.multiply(blocks, scales[first : first + full, None], out=blocks)
        if full * nested_blocksize < len(part):
            np.multiply(part[full * nested_blocksize :], scales[first + full], out=part[full * nested_blocksize :])
        np.add(part, shift, out=part)

    _parallel.run(-(-len(out_np) // step), task)
    return out


class _Scratch:
    def __init__(self, task: int) -> None:
        self.index_t = torch.empty(task // 2 + 1, dtype=torch.int32)
        self.index = self.index_t.numpy()
        self.pairs_t = torch.empty(task // 2 + 1, dtype=torch.float64)
        self.pairs = self.pairs_t.numpy()
        self.raw = np.empty(task * 8, np.uint8)  # a non-contiguous source's range, as whatever dtype it has
        self.x = np.empty(task, np.float32)


_local = threading.local()


def _scratch(count: int) -> _Scratch:
    """This thread's buffers for ranges of up to `count` elements (kept for the next range that fits)."""
    cached = getattr(_local, "compare", None)
    if cached is None or cached[0] < count:
        cached = _local.compare = (count, _Scratch(count))
    return cached[1]
