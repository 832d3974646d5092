"""A CPU 4-bit quantizer whose bytes equal bitsandbytes' CUDA kernel (``kQuantizeBlockwise``).

What the CUDA kernel does, per block of ``blocksize`` consecutive elements of the flattened tensor:

1. ``absmax = max |x|`` over the block (flush-to-zero: denormals count as 0);
2. ``r = 1.0f / absmax``, compiled under fast math to the approximate reciprocal ``MUFU.RCP``;
3. each element's code is a decision tree on ``y = x * r`` (``dQuantizeNF4`` / ``dQuantizeFP4``);
4. two codes per byte, element 2j in the high nibble; an odd tail is padded with a zero input.

An all-zero block has ``r = inf`` and ``0 * inf = NaN``, which every comparison rejects: code 0.

This module does the same with vectorized operations on block-aligned pieces of the flattened tensor,
each piece taken through every pass by one thread of a pool (`_parallel`, `_quantize4`), so the extra
memory is at most about 20 MiB per thread whatever the tensor size and the work scales with the cores.
The pieces that make the bytes exact live beside it: `_fastmath` (flush-to-zero, the measured reciprocal),
`_tables` (code tables, the decision tree as lookup tables), `_cuda_mean` (torch's CUDA mean, for double
quantization), `_dynamic8` (its 8-bit step).
"""

from __future__ import annotations

import math

import torch

from . import _parallel, _quantize4, _tables
from ._cuda_mean import cuda_mean
from ._dynamic8 import quantize_8bit

__all__ = ["NonFiniteError", "code_table", "dynamic_map", "quantize_4bit", "quantize_nested"]

BLOCKSIZES = (64, 128, 256, 512, 1024, 2048, 4096)
QUANT_TYPES = ("nf4", "fp4")
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Elements a thread takes through the codes pass at once, on one thread: its buffers (about 15 bytes per
# element) stay in the core's L2 cache. With more threads the pieces grow up to PIECE_CAP, so that each
# numpy call's loop outlasts the GIL hand-overs around it (`_parallel.task_elements` has the figures).
# Powers of two >= 4096, so multiples of every blocksize. Tests set CHUNK_ELEMENTS (None: the rule above)
# to cross piece edges on small inputs.
PIECE_ELEMENTS = 1 << 16
PIECE_CAP = 1 << 20
CHUNK_ELEMENTS: int | None = None
# Elements per task, at least: a task's block scales (the reciprocals' fixed cost) are computed together,
# and the task is what one thread takes from the pool (a millisecond or more of work).
TASK_ELEMENTS = 1 << 18
# Absmax values per step of double quantization (a multiple of its blocksize, 256; see `quantize_nested`).
NESTED_CHUNK = 1 << 20


class NonFiniteError(ValueError):
    """input holds NaN or Inf"""


def code_table(quant_type: str) -> torch.Tensor:
    """float32 [16]: the table stored as ``quant_map`` (bytes equal to bitsandbytes' table)."""
    return _tables.code_table(quant_type).clone()


def dynamic_map() -> torch.Tensor:
    """float32 [256]: the table stored as ``nested_quant_map`` (bitsandbytes' signed dynamic map)."""
    return _tables.dynamic_map().clone()


def quantize_4bit(x: torch.Tensor, *, quant_type: str, blocksize: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` to packed 4-bit codes exactly as bitsandbytes' CUDA ``quantize_4bit`` does.

    x: any shape, float32/float16/bfloat16, on the CPU, contiguous or not (read in chunks, never copied
    whole). Returns (packed, absmax): packed uint8 1-D of length ceil(n/2) (element 2j in the high nibble,
    2j+1 in the low), absmax float32 1-D of length ceil(n/blocksize). Raises NonFiniteError if x holds NaN
    or Inf, ValueError for an unsupported quant_type, blocksize, dtype or device.
    """
    _check_args(x, quant_type, blocksize)
    n = x.numel()
    packed = torch.empty((n + 1) // 2, dtype=torch.uint8)
    absmax = torch.empty(-(-n // blocksize), dtype=torch.float32)
    try:
        piece = _chunk_elements()
        job = _quantize4.Job(x, quant_type, blocksize, piece, max(1, TASK_ELEMENTS // piece), packed, absmax)
        _parallel.run(job.tasks, job.run_task)
    except _quantize4.NonFinite as e:
        raise NonFiniteError(str(e)) from None
    return packed, absmax


def quantize_nested(absmax: torch.Tensor, *, blocksize: int = 256) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Double quantization of a float32 absmax vector exactly as bitsandbytes does it on CUDA.

    bitsandbytes computes ``offset = absmax.mean()`` (torch's CUDA reduction, replayed by `cuda_mean`),
    then 8-bit blockwise quantizes ``absmax - offset`` with its dynamic map (``kQuantizeBlockwise``,
    General8bit). Returns (codes uint8 [len(absmax)], nested_absmax float32 [ceil(len/blocksize)], offset)
    where offset is the Python float stored as ``nested_offset`` in the quant-state JSON.
    """
    if blocksize not in BLOCKSIZES:
        raise ValueError(f"blocksize must be one of {BLOCKSIZES}, got {blocksize}")
    values = absmax.detach().reshape(-1).to(device="cpu", dtype=torch.float32)
    if values.numel() == 0:
        raise ValueError("quantize_nested needs at least one absmax value")
    low, high = values.numpy().min(), values.numpy().max()  # NaN propagates through both
    if not (math.isfinite(low) and math.isfinite(high)):
        raise NonFiniteError("absmax holds NaN or Inf")
    offset = cuda_mean(values)
    n = values.numel()
    codes = torch.empty(n, dtype=torch.uint8)
    nested_absmax = torch.empty(-(-n // blocksize), dtype=torch.float32)
    # Steps of torch operations on the calling thread, not tasks on the pool: there are 64x fewer absmax
    # values than weights, too few for tasks long enough to outlast the GIL's hand-overs, while torch spreads
    # each operation of a large step over its own threads.
    step = max(blocksize, NESTED_CHUNK // blocksize * blocksize)
    for start in range(0, n, step):
        # bitsandbytes subtracts with a plain torch op (IEEE, no flush); the kernel then flushes.
        chunk_codes, chunk_absmax = quantize_8bit(values[start : start + step] - offset, blocksize)
        codes[start : start + chunk_codes.numel()] = chunk_codes
        nested_absmax[start // blocksize : start // blocksize + chunk_absmax.numel()] = chunk_absmax
    return codes, nested_absmax, float(offset)


def _chunk_elements() -> int:
    """Elements per piece of the codes pass: a multiple of every blocksize (and even)."""
    return CHUNK_ELEMENTS if CHUNK_ELEMENTS is not None else _parallel.task_elements(PIECE_ELEMENTS, PIECE_CAP)


def _check_args(x: torch.Tensor, quant_type: str, blocksize: int) -> None:
    if quant_type not in QUANT_TYPES:
        raise ValueError(f"quant_type must be 'nf4' or 'fp4', got {quant_type!r}")
    if blocksize not in BLOCKSIZES:
        raise ValueError(f"blocksize must be one of {BLOCKSIZES}, got {blocksize}")
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"4-bit quantization takes float32, float16 or bfloat16, got {x.dtype}")
    if x.device.type != "cpu":
        raise ValueError(f"the CPU kernel needs a CPU tensor, got one on {x.device}")
