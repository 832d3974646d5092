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
# outlasts the GIL's hand-overs (`_parallel.task_elements`): on the GPU machine's 16 cores 128 Ki-element
# tasks made 0.69 GB/s on 16 threads (1.0 on one), 1 Mi-element tasks 3.25 GB/s (0.79 on one)
# (`scripts/profile_cpu_kernel.py --only stats`).
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
    # Two factors, so that neither overflows float32 (|exponent| <= 149 for finite float32 scales).
    half = exponent // 2
    factors = (np.float32(2.0**-half), np.float32(2.0 ** -(exponent - half)))
    codes_np, absmax_np = codes.numpy(), absmax.float().contiguous().numpy()
    if exponent:  # the decoded values scale with their block's absmax
        absmax_np = absmax_np * factors[0] * factors[1]
    step = max(blocksize, TASK_ELEMENTS // blocksize * blocksize)
    tasks = -(-n // step)
    partial: list[tuple[float, float, float]] = [(0.0, 0.0, 0.0)] * tasks

    def task(i: int) -> None:
        start = i * step
        end = min(start + step, n)
        s = _scratch(step)
        count = end - start
        pair_count = (count + 1) // 2
        np.copyto(s.index[:pair_count], codes_np[start // 2 : start // 2 + pair_count])
        torch.index_select(pairs, 0, s.index_t[:pair_count], out=s.pairs_t[:pair_count])
        values = s.pairs[:pair_count].view(np.float32)[:count]
        full, first = count // blocksize, start // blocksize
        block_values = values[: full * blocksize].reshape(full, blocksize)
        np.multiply(block_values, absmax_np[first : first + full, None], out=block_values)
        if full * blocksize < count:  # the tensor's last, partial block
            np.multiply(values[full * blocksize :], absmax_np[first + full], out=values[full * blocksize :])
        x = _flat.float32(src.range(start, end, s.raw.view(src.dtype)), source.dtype, s.x[:count])
        if exponent:  # into the scratch buffer: x may be the source's own memory
            x = np.multiply(x, factors[0], out=s.x[:count])
            np.multiply(x, factors[1], out=x)
        diff = np.subtract(values, x, out=values)
        max_err = float(np.maximum(diff.max(), -diff.min()))  # NaN propagates, as it should
        # einsum's float32 dot product: vectorized, single-threaded (np.dot would call a threaded BLAS), and
        # over one task its rounding stays far below the 6 digits kept; the tasks' sums are added exactly.
        err2 = float(np.einsum("i,i->", diff, diff))
        ref2 = float(np.einsum("i,i->", x, x))
        partial[i] = (err2, ref2, max_err)

    _parallel.run(tasks, task)
    err2 = math.fsum(p[0] for p in partial)
    ref2 = math.fsum(p[1] for p in partial)
    max_err = max((p[2] for p in partial), default=0.0, key=lambda v: math.inf if math.isnan(v) else v)
    return err2, ref2, max_err


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


def _scratch(task: int) -> _Scratch:
    cached = getattr(_local, "compare", None)
    if cached is None or cached[0] != task:
        cached = _local.compare = (task, _Scratch(task))
    return cached[1]
