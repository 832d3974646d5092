"""A CPU 4-bit quantizer whose bytes equal bitsandbytes' CUDA kernel (``kQuantizeBlockwise``).

What the CUDA kernel does, per block of ``blocksize`` consecutive elements of the flattened tensor:

1. ``absmax = max |x|`` over the block (flush-to-zero: denormals count as 0);
2. ``r = 1.0f / absmax``, compiled under fast math to the approximate reciprocal ``MUFU.RCP``;
3. each element's code is a decision tree on ``y = x * r`` (``dQuantizeNF4`` / ``dQuantizeFP4``);
4. two codes per byte, element 2j in the high nibble; an odd tail is padded with a zero input.

An all-zero block has ``r = inf`` and ``0 * inf = NaN``, which every comparison rejects: code 0.

This module does the same with vectorized torch operations over fixed-size chunks, so the extra memory
is a few MiB whatever the tensor size, and torch's intra-op threads use every core. The pieces that make
the bytes exact live beside it: `_fastmath` (flush-to-zero, the measured reciprocal), `_tables` (code
tables, the decision tree as lookup tables), `_cuda_mean` (torch's CUDA mean, for double quantization).
"""

from __future__ import annotations

import torch

from . import _fastmath, _tables
from ._cuda_mean import cuda_mean
from ._dynamic8 import block_absmax, quantize_8bit

__all__ = ["NonFiniteError", "code_table", "dynamic_map", "quantize_4bit", "quantize_nested"]

BLOCKSIZES = (64, 128, 256, 512, 1024, 2048, 4096)
QUANT_TYPES = ("nf4", "fp4")
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Elements per chunk and thread (the chunk is this times torch's intra-op thread count, a power of two),
# measured best on 1-16 threads: about 18 bytes of buffers per element, so 4.5 MiB per thread, with few
# enough torch ops per element that their dispatch and thread start-up cost stays small. Capped so that
# many-core machines stay under ~80 MB of buffers. None: automatic; tests set a fixed CHUNK_ELEMENTS.
CHUNK_ELEMENTS_PER_THREAD = 1 << 18
MAX_CHUNK_ELEMENTS = 1 << 22
CHUNK_ELEMENTS: int | None = None
# Chunks whose statistics are computed together: the reciprocals' fixed cost is shared by the span, and
# the span's input is re-read for the codes while it is still in cache.
CHUNKS_PER_SPAN = 8


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
    n, chunk = x.numel(), _chunk_elements()
    kernel = _Kernel(x, quant_type, blocksize, chunk)
    packed = torch.empty((n + 1) // 2, dtype=torch.uint8)
    absmax = torch.empty(-(-n // blocksize), dtype=torch.float32)
    # Like the CUDA kernel's two phases, two passes over each span of a few chunks: every block's absmax
    # (and reciprocal, computed once for the span), then the codes chunk by chunk while the span's input
    # is still in cache.
    span = chunk * CHUNKS_PER_SPAN
    for span_start in range(0, n, span):
        span_stop = min(span_start + span, n)
        blocks = slice(span_start // blocksize, -(-span_stop // blocksize))
        absmax[blocks] = kernel.block_absmax(span_start, span_stop)
        scale, zero_blocks = _block_scale(absmax[blocks])
        for start in range(span_start, span_stop, chunk):
            stop = min(start + chunk, span_stop)
            first = (start - span_start) // blocksize
            rows = slice(first, first + -(-(stop - start) // blocksize))
            codes = kernel.codes(start, stop, scale[rows], None if zero_blocks is None else zero_blocks[rows])
            packed[start // 2 : start // 2 + codes.numel()] = codes
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
    if not bool(torch.isfinite(values).all()):
        raise NonFiniteError("absmax holds NaN or Inf")
    offset = cuda_mean(values)
    n = values.numel()
    codes = torch.empty(n, dtype=torch.uint8)
    nested_absmax = torch.empty(-(-n // blocksize), dtype=torch.float32)
    step = _chunk_elements()  # a multiple of every blocksize
    for start in range(0, n, step):
        # bitsandbytes subtracts with a plain torch op (IEEE, no flush); the kernel then flushes.
        shifted = values[start : start + step] - offset
        chunk_codes, chunk_absmax = quantize_8bit(shifted, blocksize)
        codes[start : start + chunk_codes.numel()] = chunk_codes
        nested_absmax[start // blocksize : start // blocksize + chunk_absmax.numel()] = chunk_absmax
    return codes, nested_absmax, float(offset)


def _chunk_elements() -> int:
    """Elements per chunk: a power of two >= 4096, so a multiple of every blocksize (and even)."""
    if CHUNK_ELEMENTS is not None:
        return CHUNK_ELEMENTS
    threads = max(1, torch.get_num_threads())
    return min(CHUNK_ELEMENTS_PER_THREAD << (threads - 1).bit_length(), MAX_CHUNK_ELEMENTS)


def _check_args(x: torch.Tensor, quant_type: str, blocksize: int) -> None:
    if quant_type not in QUANT_TYPES:
        raise ValueError(f"quant_type must be 'nf4' or 'fp4', got {quant_type!r}")
    if blocksize not in BLOCKSIZES:
        raise ValueError(f"blocksize must be one of {BLOCKSIZES}, got {blocksize}")
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"4-bit quantization takes float32, float16 or bfloat16, got {x.dtype}")
    if x.device.type != "cpu":
        raise ValueError(f"the CPU kernel needs a CPU tensor, got one on {x.device}")


class _Kernel:
    """kQuantizeBlockwise for one tensor, one chunk at a time, in preallocated buffers (fixed memory)."""

    def __init__(self, x: torch.Tensor, quant_type: str, blocksize: int, chunk: int) -> None:
        self.x = x
        self.chunk = chunk
        self.flat = x.reshape(-1) if x.is_contiguous() else None  # a view; otherwise read slice by slice
        self.n = x.numel()
        self.blocksize = blocksize
        # float16 values are all normal float32 values once converted: nothing to flush.
        self.flush_inputs = x.dtype != torch.float16
        self.base, self.split, self.byte_map = _tables.bucket_tables(quant_type)
        size = min(chunk, -(-self.n // blocksize) * blocksize)
        self.values = torch.empty(size, dtype=torch.float32)
        self.scaled = torch.empty(size, dtype=torch.float32)
        self.keys = torch.empty(size, dtype=torch.int32)
        self.ranks = torch.empty(size, dtype=torch.uint8)
        self.splits = torch.empty(size, dtype=torch.float32)
        self.above = torch.empty(size, dtype=torch.bool)
        self.packed = torch.empty(size // 2, dtype=torch.uint8)

    def _load(self, start: int, stop: int) -> torch.Tensor:
        """Elements [start, stop) as float32, padded with zeros to whole blocks (as the kernel loads)."""
        count = stop - start
        padded = -(-count // self.blocksize) * self.blocksize
        buf = self.values[:padded]
        if self.flat is not None:
            buf[:count].copy_(self.flat[start:stop])  # converts to float32 on the way
        else:
            _copy_flat_range(self.x, start, stop, buf)
        buf[count:] = 0.0
        return buf

    def block_absmax(self, start: int, stop: int) -> torch.Tensor:
        """Pass 1: float32 max |x| of each block in [start, stop), as the kernel sees it (flushed)."""
        bs = self.blocksize
        absmax = torch.empty(-(-(stop - start) // bs), dtype=torch.float32)
        for pos in range(start, stop, self.chunk):
            blocks = self._load(pos, min(pos + self.chunk, stop)).view(-1, bs)
            first = (pos - start) // bs
            absmax[first : first + blocks.shape[0]] = block_absmax(blocks)
        # max and min propagate NaN and Inf, so checking absmax checks every element.
        if not bool(torch.isfinite(absmax).all()):
            raise NonFiniteError("input holds NaN or Inf")
        if self.flush_inputs:  # fabsf/fmaxf flush denormals: a block of denormals has absmax 0
            absmax = torch.where(absmax < _fastmath.FLT_MIN, 0.0, absmax)
        return absmax

    def codes(self, start: int, stop: int, scale: torch.Tensor, zero_blocks: torch.Tensor | None) -> torch.Tensor:
        """Pass 2: packed codes of elements [start, stop), given those blocks' scales (see `_block_scale`)."""
        bs = self.blocksize
        x = self._load(start, stop)
        if self.flush_inputs:
            _fastmath.flush_denormals_(x)
        blocks = x.view(-1, bs)
        y = self.scaled[: x.numel()]
        torch.mul(blocks, scale[:, None], out=y.view(-1, bs))  # one IEEE float32 product (FMUL)
        ranks = self._ranks(y)
        if self.byte_map is not None:
            self._fp4_sign_at_flt_min(x, y, scale, ranks)
        packed = self._pack(ranks)
        if zero_blocks is not None:
            packed.view(-1, bs // 2)[zero_blocks] = 0
        return packed[: (stop - start + 1) // 2]

    def _ranks(self, y: torch.Tensor) -> torch.Tensor:
        """Each scaled value's rank among the kernel's split points (see `_tables.bucket_tables`)."""
        count = y.numel()
        keys, ranks = self.keys[:count], self.ranks[:count]
        splits, above = self.splits[:count], self.above[:count]
        # Bucket key = top 16 bits of y as an unsigned number (arithmetic shift, then drop the sign fill).
        torch.bitwise_right_shift(y.view(torch.int32), 16, out=keys).bitwise_and_(0xFFFF)
        torch.index_select(self.base, 0, keys, out=ranks)
        torch.index_select(self.split, 0, keys, out=splits)
        torch.gt(y, splits, out=above)
        return ranks.add_(above)

    def _fp4_sign_at_flt_min(self, x: torch.Tensor, y: torch.Tensor, scale: torch.Tensor, ranks: torch.Tensor) -> None:
        """FP4 takes its sign bit from y < 0 after the GPU's flush-to-zero, and the GPU decides to flush
        from the product rounded to 24 bits as if the exponent were unbounded, while the CPU's y rounds on
        the denormal grid. The two only disagree when the CPU's y is exactly -FLT_MIN: decide those from
        the exact product (float32 x float32 is exact in float64)."""
        at_limit = torch.eq(y, -_fastmath.FLT_MIN, out=self.above[: y.numel()])
        if not bool(at_limit.any()):
            return
        where = at_limit.nonzero().view(-1)
        exact = x[where].double() * scale[where // self.blocksize].double()
        flushed = _fastmath.mul_ftz_flushes(exact)
        negative_rank = _tables.FP4_NEGATIVE_ZERO_RANK  # rank of [-0.0026, -FLT_MIN]: code 0b1000
        ranks[where] = torch.where(flushed, negative_rank + 1, negative_rank).to(torch.uint8)

    def _pack(self, ranks: torch.Tensor) -> torch.Tensor:
        """Two codes per byte, element 2j in the high nibble."""
        count = ranks.numel()
        pairs = ranks.view(-1, 2)
        packed = self.packed[: count // 2]
        if self.byte_map is None:  # NF4: the ranks are the codes
            torch.add(pairs[:, 1], pairs[:, 0], alpha=16, out=packed)
        else:  # FP4: pack the ranks, then one table lookup per byte turns both into codes
            rank_pairs = self.keys[: count // 2]  # free again, and index_select wants int32 indices
            torch.add(pairs[:, 1], pairs[:, 0], alpha=16, out=rank_pairs)
            torch.index_select(self.byte_map, 0, rank_pairs, out=packed)
        return packed


def _block_scale(absmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The kernel's ``1.0f / absmax`` per block (MUFU.RCP), and which blocks are all zero (or None).

    An all-zero block has 1/0 = inf and 0 * inf = NaN, which every comparison of the decision tree
    rejects: code 0 for all its elements. Its scale here is 0 (no NaN to carry around) and `codes`
    writes its bytes as 0.
    """
    zero = absmax == 0
    scale = torch.where(zero, 0.0, _fastmath.rcp_approx_ftz(absmax))
    return scale, (zero if bool(zero.any()) else None)


def _copy_flat_range(x: torch.Tensor, start: int, stop: int, out: torch.Tensor) -> None:
    """Copy elements [start, stop) of x's row-major flattening into out (as float32), for any strides.

    Only slices of x are read, so a non-contiguous tensor is never copied whole: whole rows in the
    middle of the range go in one strided copy, partial rows at either end recurse into that row.
    """
    if x.dim() <= 1:
        out[: stop - start].copy_(x.reshape(-1)[start:stop])
        return
    inner = x[0].numel()
    first, last = start // inner, (stop - 1) // inner
    if first == last:
        _copy_flat_range(x[first], start - first * inner, stop - first * inner, out)
        return
    pos = 0
    if start % inner:
        head_end = (first + 1) * inner
        _copy_flat_range(x[first], start - first * inner, inner, out)
        pos, first = head_end - start, first + 1
    full_end = last if stop % inner else last + 1
    if full_end > first:
        rows = x[first:full_end]
        out[pos : pos + rows.numel()].view(rows.shape).copy_(rows)
        pos += rows.numel()
    if stop % inner:
        _copy_flat_range(x[last], 0, stop - last * inner, out[pos:])
