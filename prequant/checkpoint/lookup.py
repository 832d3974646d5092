"""Dequantization by table lookup: the core every quantized format's `dequantize` shares.

A quantized element is a small code (256 float8 values, 16 INT4 or FP4 values) and a scale shared by a block, a group,
a row or the tensor. So every dequantized value is an entry of a small table per scale, computed once with the
format's own operations (the product in float32, rounded as its reference rounds); the weight is then a lookup in that
table (`index_select`), several times faster on a CPU than computing each element, and the same bytes on any device.

Standard library only at import.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from .codes import ITEMSIZE  # bytes per element of the model dtypes weights dequantize to (fp8, int4, mxfp4 size by it)

if TYPE_CHECKING:
    import torch

# Elements dequantized at a time, whatever the weight size: on a CPU a piece's int32 indices stay in a core's cache;
# on a GPU a piece is large enough that kernel launches cost nothing beside it.
CPU_PIECE = 1 << 18
CUDA_PIECE = 1 << 24
Each = Callable[[int, Callable[[int], None]], None]  # each(count, work): work(i) for i in range(count)


def starts(rows: int, cols: int, block: tuple[int, int] | None, codes: int,
           device: torch.device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Where each element's table begins in a flat table of `codes` entries per scale, the scales one per `block`
    (rows by columns, the edge blocks partial) in row-major order: (per row [rows, 1], per column [cols]), to add
    to the codes; None where all rows (or all columns) share it. `block` None: one scale for the tensor."""
    import torch

    if block is None:
        return None, None
    per_row = -(-cols // block[1])
    row = torch.arange(rows, dtype=torch.int32, device=device).div_(block[0], rounding_mode="floor")
    row = row.mul_(per_row * codes).unsqueeze(1)
    if per_row == 1:
        return row, None
    col = torch.arange(cols, dtype=torch.int32, device=device).div_(block[1], rounding_mode="floor").mul_(codes)
    return row, col


def lookup(table: torch.Tensor, shape: tuple[int, int], index: Callable[[int, int], torch.Tensor],
           begin: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
           each: Each | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """The [rows, cols] tensor of `table`'s dtype, on its device, whose rows a..b are `table[index(a, b) + begin]`:
    `index(a, b)` gives those rows' codes as a fresh int32 [b - a, cols] tensor, `begin` the table offsets of `starts`.
    `each(count, work)` runs `work(i)` for every piece of rows i (default: one after the other; the pipeline passes
    its CPU threads). `out`, where given, is the [rows, cols] tensor written and returned (a strided view, such as a
    transposed tensor's, takes each piece through a piece-sized copy)."""
    import torch

    rows, cols = shape
    if out is None:
        out = torch.empty(shape, dtype=table.dtype, device=table.device)
    if out.numel() == 0:
        return out
    flat = out.view(-1) if out.is_contiguous() else None
    row_start, col_start = begin
    step = max(1, (CUDA_PIECE if table.device.type == "cuda" else CPU_PIECE) // cols)

    def piece(i: int) -> None:
        a, b = i * step, min(rows, (i + 1) * step)
        at = index(a, b)
        if row_start is not None:
            at += row_start[a:b]
        if col_start is not None:
            at += col_start
        if flat is not None:
            torch.index_select(table, 0, at.view(-1), out=flat[a * cols : b * cols])
        else:
            out[a:b] = torch.index_select(table, 0, at.view(-1)).view(b - a, cols)

    (each or one_by_one)(-(-rows // step), piece)
    return out


def one_by_one(count: int, work: Callable[[int], None]) -> None:
    for i in range(count):
        work(i)


def nibbles(packed: torch.Tensor, cols: int) -> torch.Tensor:
    """The 4-bit codes of uint8 rows holding two a byte, the low nibble first: int32 [rows, cols]."""
    import torch

    pairs = torch.stack((packed & 0x0F, packed >> 4), dim=-1).view(packed.shape[0], -1)
    return pairs[:, :cols].to(torch.int32)
