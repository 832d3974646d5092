"""One task of the 4-bit kernel: a block-aligned range of the flattened tensor, taken through every pass by
one thread (see `_parallel`), in numpy on buffers that thread keeps.

Per task (a quarter million to a million elements), as the CUDA kernel's two phases:

1. absmax of each block from the input's *bits*: ``|x|`` is the bits without the sign, and for finite
   floats the integer order of those is their order as numbers, so a masked integer max gives each
   block's absmax exactly, reading the 2 bytes of a bf16 once instead of converting it first; NaN and
   Inf are the bit patterns at or above the exponent's all-ones, so the same max finds them;
2. the reciprocal of every block's absmax at once (`_fastmath`, MUFU.RCP; for 16-bit inputs one lookup
   in a table of the reciprocal of every 16-bit magnitude), then the codes piece by piece (``PIECE``
   elements, sized for the core's cache): float32 values, ``y = x * r``, the bucket key of each ``y``
   (its top 16 bits), the rank lookup of `_tables.bucket_tables` (and a compare for the values whose bucket
   holds a split), and two codes per byte.

Flush-to-zero: a denormal input counts as zero on the GPU. A block of denormals has absmax 0 here too
(its max is below the smallest normal), and a task whose bits show no denormal at all (the usual case)
skips flushing its values.
"""

from __future__ import annotations

import functools
import sys
import threading

import numpy as np
import torch

from . import _fastmath, _flat, _tables

_LITTLE_ENDIAN = sys.byteorder == "little"
_NEG_FLT_MIN = np.float32(-_fastmath.FLT_MIN)
_RANK_MASK = np.uint8(0xFF ^ _tables.SPLIT_FLAG)


class _Format:
    """How one input dtype looks as bits: integer type, |x| mask, first non-finite and first normal pattern."""

    def __init__(self, bits: np.dtype, mask: int, non_finite: int, normal: int, flush: bool) -> None:
        self.bits, self.mask, self.non_finite, self.normal, self.flush = bits, mask, non_finite, normal, flush


# float16 inputs are all normal float32 values once converted: nothing to flush.
FORMATS = {
    torch.bfloat16: _Format(np.dtype(np.uint16), 0x7FFF, 0x7F80, 0x0080, flush=True),
    torch.float16: _Format(np.dtype(np.uint16), 0x7FFF, 0x7C00, 0x0400, flush=False),
    torch.float32: _Format(np.dtype(np.uint32), 0x7FFFFFFF, 0x7F800000, 0x00800000, flush=True),
}


class NonFinite(ValueError):
    """A task's input holds NaN or Inf (cpu.py turns it into its public NonFiniteError)."""


class Job:
    """kQuantizeBlockwise of one tensor into `packed` and `absmax`, as `tasks` independent tasks."""

    def __init__(self, x: torch.Tensor, quant_type: str, blocksize: int, piece: int, task_pieces: int,
                 packed: torch.Tensor, absmax: torch.Tensor) -> None:  # fmt: skip
        self.fmt = FORMATS[x.dtype]
        self.dtype = x.dtype
        self.n, self.bs = x.numel(), blocksize
        self.piece = max(blocksize, piece // blocksize * blocksize)
        self.task = self.piece * task_pieces
        self.tasks = -(-self.n // self.task)
        self.source = _flat.Flat(x, bits=True)  # the input's bits, read range by range
        self.ranks_t, self.split, self.byte_map = _tables.bucket_tables(quant_type)
        self.reciprocals = _reciprocals(x.dtype) if x.dtype != torch.float32 else None
        # torch's operations run vectorized, often twice as fast as numpy's over short rows, but with threads of
        # its own torch forks onto them from every pool thread; cut below its grain instead, the calls are much
        # shorter than a piece and each hands the GIL over. So torch only where it has one thread.
        self.torch_inline = torch.get_num_threads() == 1
        self.packed, self.absmax = packed.numpy(), absmax.numpy()

    def run_task(self, i: int) -> None:
        """Task i: absmax and packed codes of elements [i * task, (i + 1) * task), written into the outputs."""
        start = i * self.task
        stop = min(start + self.task, self.n)
        s = _scratch(self)
        bs, fmt = self.bs, self.fmt
        blocks = -(-(stop - start) // bs)
        bits = self._bits(start, stop, s.xbits[: blocks * bs])
        mag = np.bitwise_and(bits, fmt.mask, out=s.mag[: blocks * bs])
        top = _block_max(s, blocks, bs, self.torch_inline)
        if top.max() >= fmt.non_finite:
            raise NonFinite("input holds NaN or Inf")
        if fmt.flush:  # fabsf/fmaxf flush denormals: a block of denormals has absmax 0
            top[top < fmt.normal] = 0
        absmax = self.absmax[start // bs : start // bs + blocks]
        _absmax_values(top, self.dtype, absmax)
        zero = absmax == 0
        has_zero = bool(zero.any())
        if self.reciprocals is not None:  # 16-bit inputs: 32768 possible magnitudes, each reciprocal computed once
            scale = np.take(self.reciprocals, top)
        else:
            scale = _fastmath.rcp_approx_ftz_array(absmax)
        if has_zero:  # 1/0 = inf, and 0 * inf = NaN, which every comparison rejects: code 0 (set below)
            scale = np.where(zero, np.float32(0), scale)
        # Any denormal in the task? (|x| - 1, wrapping 0 to the top, is then below the first normal - 1.)
        denormals = fmt.flush and int(np.subtract(mag, 1, out=mag).min()) < fmt.normal - 1
        for p in range(0, blocks * bs, self.piece):
            q = min(p + self.piece, blocks * bs)
            rows = slice(p // bs, q // bs)
            out_start = (start + p) // 2
            count = (min(stop - start, q) - p + 1) // 2
            codes = self._codes(s, bits[p:q], scale[rows], denormals)
            if has_zero:
                codes.reshape(-1, bs // 2)[zero[rows]] = 0
            self.packed[out_start : out_start + count] = codes[:count]

    def _bits(self, start: int, stop: int, buf: np.ndarray) -> np.ndarray:
        """The input's bits [start, stop) padded with +0.0 to whole blocks: a view where possible."""
        bits = self.source.range(start, stop, buf)
        if len(bits) == len(buf):
            return bits
        buf[: len(bits)] = bits  # the tensor's last, partial block: pad it as the kernel does
        buf[len(bits) :] = 0
        return buf

    def _codes(self, s: _Scratch, bits: np.ndarray, scale: np.ndarray, denormals: bool) -> np.ndarray:
        """Packed codes (uint8, len(bits) // 2, a scratch buffer) of whole blocks given their scales."""
        v = s.views(len(bits), self.bs)
        if self.dtype == torch.bfloat16:
            values = _flat.float32(bits, self.dtype, v.y).reshape(v.y2d.shape)
        else:  # float16 and float32 go straight into the product (float16 converts exactly)
            values = bits.view(np.float16 if self.dtype == torch.float16 else np.float32).reshape(v.y2d.shape)
        # One IEEE float32 product (FMUL) per element, by torch where it may (`torch_inline`: half numpy's time
        # over rows this short); bf16 values are already in y.
        if self.dtype == torch.bfloat16 and self.torch_inline:
            v.y_t.mul_(torch.from_numpy(scale)[:, None])
        else:
            np.multiply(values, scale[:, None], out=v.y2d)
        if denormals:  # the GPU sees them as zeros: x * r = 0
            v.y[np.bitwise_and(bits, self.fmt.mask) < self.fmt.normal] = 0
        np.right_shift(v.wide, 16, out=v.keys)  # bucket key: the top 16 bits of y
        torch.index_select(self.ranks_t, 0, v.keys_t, out=v.ranks_t)
        near = np.flatnonzero(np.greater_equal(v.ranks, _tables.SPLIT_FLAG, out=v.above))
        if len(near):  # the few values whose bucket holds a split: their rank goes up by one above it
            above = v.y[near] > self.split[v.keys[near]]
            v.ranks[near] = np.bitwise_and(v.ranks[near], _RANK_MASK) + above
        if self.byte_map is not None:
            self._fp4_sign_at_flt_min(bits, v.y, scale, v.ranks, v.above)
        packed = _pack(v.ranks, v.pairs, v.packed)
        if self.byte_map is not None:  # FP4: both ranks of a byte to both codes, one lookup
            np.take(self.byte_map, packed, out=packed)
        return packed

    def _fp4_sign_at_flt_min(self, bits: np.ndarray, y: np.ndarray, scale: np.ndarray, ranks: np.ndarray,
                             scratch: np.ndarray) -> None:  # fmt: skip
        """FP4 takes its sign bit from y < 0 after the GPU's flush-to-zero, and the GPU decides to flush
        from the product rounded to 24 bits as if the exponent were unbounded, while the CPU's y rounds on
        the denormal grid. The two only disagree when the CPU's y is exactly -FLT_MIN: decide those from
        the exact product (float32 x float32 is exact in float64)."""
        at_limit = np.equal(y, _NEG_FLT_MIN, out=scratch)
        if not at_limit.any():
            return
        where = np.flatnonzero(at_limit)
        x = _values(bits[where], self.dtype)
        exact = torch.from_numpy(x.astype(np.float64) * scale[where // self.bs].astype(np.float64))
        flushed = _fastmath.mul_ftz_flushes(exact).numpy()
        negative_rank = _tables.FP4_NEGATIVE_ZERO_RANK  # rank of [-0.0026, -FLT_MIN]: code 0b1000
        ranks[where] = np.where(flushed, negative_rank + 1, negative_rank)


def _block_max(s: _Scratch, blocks: int, blocksize: int, torch_inline: bool) -> np.ndarray:
    """The largest magnitude bits of each block of ``s.mag`` into ``s.top``: by torch's integer max over rows
    where it may (`Job.torch_inline`; 3-5x numpy's over a short axis, and the magnitudes have no sign bit, so
    their signed view orders alike), else by numpy's, one call per task."""
    if torch_inline:
        mag, top = s.mag_t[: blocks * blocksize].view(blocks, blocksize), s.top_t[:blocks]
        torch.amax(mag, dim=1, out=top)
        return s.top[:blocks]
    return s.mag[: blocks * blocksize].reshape(blocks, blocksize).max(axis=1, out=s.top[:blocks])


@functools.cache
def _reciprocals(dtype: torch.dtype) -> np.ndarray:
    """float32 [32768]: MUFU.RCP of the value of every 16-bit magnitude pattern of `dtype` (inf for zero; the
    patterns of Inf and NaN, which the kernel refuses before any reciprocal, give what rcp gives them)."""
    with np.errstate(invalid="ignore"):
        return _fastmath.rcp_approx_ftz_array(np.ascontiguousarray(_values(np.arange(0x8000, dtype=np.uint16), dtype)))


def _absmax_values(top: np.ndarray, dtype: torch.dtype, out: np.ndarray) -> None:
    """float32 absmax from the max |x| bits of each block."""
    if dtype == torch.bfloat16:
        np.left_shift(top.astype(np.uint32), 16, out=out.view(np.uint32))
    elif dtype == torch.float16:
        np.copyto(out, top.view(np.float16))
    else:
        np.copyto(out, top.view(np.float32))


def _values(bits: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """float32 values of some input bits."""
    if dtype == torch.bfloat16:
        return (bits.astype(np.uint32) << 16).view(np.float32)
    return bits.view(np.float16 if dtype == torch.float16 else np.float32).astype(np.float32)


def _pack(ranks: np.ndarray, pairs: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Two 4-bit values per byte, element 2j in the high nibble (on one 16-bit lane per pair)."""
    if not _LITTLE_ENDIAN:
        np.left_shift(ranks[0::2], 4, out=out)
        return np.bitwise_or(out, ranks[1::2], out=out)
    lanes = ranks.view(np.uint16)  # element 2j in the low byte, 2j + 1 in the high byte
    np.left_shift(lanes, 4, out=pairs)  # 2j to bits 4-7 (2j + 1 to bits 12-15, dropped below)
    np.right_shift(lanes, 8, out=lanes)  # 2j + 1 to bits 0-3 (the ranks are not needed any more)
    np.bitwise_or(pairs, lanes, out=pairs)
    np.copyto(out, pairs, casting="unsafe")  # the low byte
    return out


class _Scratch:
    """One thread's buffers for one task shape (1 to 20 MiB, growing with the thread count): allocated once,
    reused by every task."""

    def __init__(self, task: int, piece: int, bits: np.dtype, blocksize: int) -> None:
        self.xbits = np.empty(task, bits)
        signed = torch.int16 if bits.itemsize == 2 else torch.int32  # the magnitudes' view for torch's max
        self.mag_t = torch.empty(task, dtype=signed)
        self.mag = self.mag_t.numpy().view(bits)
        self.top_t = torch.empty(task // blocksize + 1, dtype=signed)
        self.top = self.top_t.numpy().view(bits)
        self.y = np.empty(piece, np.float32)
        self.keys_t = torch.empty(piece, dtype=torch.int32)
        self.ranks_t = torch.empty(piece, dtype=torch.uint8)
        self.above = np.empty(piece, np.bool_)
        self.pairs = np.empty(piece // 2, np.uint16)
        self.packed = np.empty(piece // 2, np.uint8)
        self._full: _Views | None = None

    def views(self, count: int, blocksize: int) -> _Views:
        """The buffers cut to `count` elements: made once for whole pieces (slicing costs as much as a small
        operation), afresh for a tensor's last, shorter piece (whose length varies from tensor to tensor)."""
        if count != len(self.y):
            return _Views(self, count, blocksize)
        if self._full is None:
            self._full = _Views(self, count, blocksize)
        return self._full


class _Views:
    def __init__(self, s: _Scratch, count: int, blocksize: int) -> None:
        self.y = s.y[:count]
        self.y2d = self.y.reshape(-1, blocksize)
        self.y_t = torch.from_numpy(self.y2d)
        self.wide = self.y.view(np.uint32)
        self.keys_t = s.keys_t[:count]
        self.keys = self.keys_t.numpy().view(np.uint32)
        self.ranks_t = s.ranks_t[:count]
        self.ranks = self.ranks_t.numpy()
        self.above = s.above[:count]
        self.pairs = s.pairs[: count // 2]
        self.packed = s.packed[: count // 2]


_local = threading.local()


def _scratch(job: Job) -> _Scratch:
    key = (job.task, job.piece, job.fmt.bits, job.bs)
    cached = getattr(_local, "scratch", None)
    if cached is None or cached[0] != key:
        cached = (key, _Scratch(job.task, job.piece, job.fmt.bits, job.bs))
        _local.scratch = cached
    return cached[1]
