"""bitsandbytes' 8-bit blockwise quantization with its dynamic map (``kQuantizeBlockwise``, General8bit), which
double quantization applies to the absmax values of a 4-bit tensor; bytes equal to the CUDA kernel's."""

from __future__ import annotations

import torch

from . import _fastmath, _tables


def block_absmax(blocks: torch.Tensor) -> torch.Tensor:
    """max |x| per row without a temporary |x| tensor; abs() turns a possible -0.0 into the kernel's +0.0."""
    return torch.maximum(blocks.amax(1), blocks.amin(1).neg()).abs()


def quantize_8bit(x: torch.Tensor, blocksize: int) -> tuple[torch.Tensor, torch.Tensor]:
    """kQuantizeBlockwise with the dynamic map (General8bit): (codes uint8 [n], absmax float32)."""
    n = x.numel()
    padded = -(-n // blocksize) * blocksize
    y = torch.zeros(padded, dtype=torch.float32)
    y[:n] = x
    _fastmath.flush_denormals_(y)
    blocks = y.view(-1, blocksize)
    absmax = block_absmax(blocks)
    scale = _fastmath.rcp_approx_ftz(absmax)
    zero_blocks = absmax == 0
    # A flushed product changes nothing here: code 127 is 0.0 and its neighbours are +-5.5e-7.
    blocks.mul_(torch.where(zero_blocks, 0.0, scale)[:, None])
    codes = _dynamic_codes(y.nan_to_num(0.0))
    codes.view(-1, blocksize)[zero_blocks] = 0  # NaN (0 * inf) walks the search tree down to code 0
    # NaN also arises when the mean of the absmax overflows to inf: x = absmax - inf = -inf, r = rcp(inf)
    # = 0 and y = -inf * 0. The kernel codes it 0 too.
    codes[y.isnan()] = 0
    return codes[:n], absmax


def _dynamic_codes(y: torch.Tensor) -> torch.Tensor:
    """dQuantize<0>: the kernel's 7-step binary search over the sorted 256-entry map, then a midpoint test.

    The search visits a perfect binary tree over indices 0..254 whose leaves are the even indices, so it
    ends at leaf p = s or s - 1 (whichever is even), s = #{i < 255 : code[i] < y}; it then compares y with
    the midpoint (code[s-1] + code[s]) * 0.5 of the two candidates. From the leaf's side, y above the
    midpoint picks s, below picks s - 1, and equality keeps the leaf, the even one of the two.
    """
    base, split, midpoint = _tables.dynamic_tables()
    keys = torch.bitwise_right_shift(y.view(torch.int32), 16).bitwise_and_(0xFFFF)
    s = base.index_select(0, keys).add_(y > split.index_select(0, keys))
    mid = midpoint.index_select(0, s.to(torch.int32))
    tie_to_odd_s = (y == mid) & (s & 1).bool()  # equality keeps the even candidate, s - 1
    return s.sub_((y < mid).to(torch.uint8)).sub_(tie_to_odd_s.to(torch.uint8))
