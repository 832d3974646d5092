"""``torch.mean`` of a 1-D float32 CUDA tensor, reproduced on the CPU in the GPU's order of additions.

Double quantization subtracts ``absmax.mean()`` from every absmax before 8-bit quantization and stores it
as ``nested_offset``, so the last bit of that float32 matters. Float addition is not associative: the
result depends on how torch's CUDA reduction (``aten/src/ATen/native/cuda/Reduce.cuh``, ``MeanOps``)
splits the vector over threads, warps and thread blocks. This module replays that schedule with float32
tensor operations (each addition is one IEEE float32 addition, as on the GPU):

* n >= 128: each thread reads float4 vectors; 4 accumulators per thread (one per lane of the vector),
  thread g reads vectors g, g + S, g + 2S, ... (S = threads in all blocks); the n % 4 tail elements go to
  accumulator 0 of the first threads of block 0; the accumulators are combined as ((a0 + a1) + a2) + a3;
* n < 128: no vectors; thread t adds elements t and t + width;
* inside a block: a halving tree (shared memory down to 32 lanes, then warp shuffles, offset 16 .. 1);
* with several blocks: the last block sums the per-block results strided by its thread count, then the
  same tree; finally ``sum * (1.0f / n)``.

The launch shape depends on the GPU only through its multiprocessor count and threads per multiprocessor,
and only for vectors of about 131072 * 4 elements or more; the defaults are the Hopper GPUs' (sm_90: 132, 2048).
"""

from __future__ import annotations

import torch

HOPPER_MULTIPROCESSORS = 132
HOPPER_THREADS_PER_MULTIPROCESSOR = 2048
_MAX_THREADS = 512  # per block, for float32 reductions
_VECTOR = 4  # elements per vectorized load


def _floor_pow2(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


def _tree_sum(values: torch.Tensor) -> torch.Tensor:
    """Per row of [rows, width] (width a power of two): value[t] += value[t + width/2], halving to 1."""
    width = values.shape[1]
    while width > 1:
        width //= 2
        values = values[:, :width] + values[:, width : 2 * width]
    return values[:, 0]


def _launch_shape(n: int, multiprocessors: int, threads_per_mp: int) -> tuple[int, int]:
    """(threads per block, blocks) that torch's setReduceConfig picks for a full reduction of n floats."""
    width = min(_floor_pow2(n // _VECTOR), _MAX_THREADS)
    values_per_thread = -(-n // width)
    blocks = 1
    # Split over blocks only when each thread would otherwise add >= 256 values (and >= 16: warps split).
    if values_per_thread >= 256:
        target_blocks = multiprocessors * (threads_per_mp // width)
        blocks = max(min(target_blocks, -(-values_per_thread // 16)), -(-values_per_thread // 256))
    return width, blocks


def _vectorized_sum(v: torch.Tensor, multiprocessors: int, threads_per_mp: int) -> torch.Tensor:
    n = v.numel()
    width, blocks = _launch_shape(n, multiprocessors, threads_per_mp)
    threads = width * blocks
    n_vectors = n // _VECTOR
    rows = -(-n_vectors // threads)
    # Zero padding is exact: a thread's accumulator starts at +0.0, and x + 0.0 == x for every x != -0.0.
    grid = torch.zeros(rows * threads * _VECTOR, dtype=torch.float32)
    grid[: n_vectors * _VECTOR] = v[: n_vectors * _VECTOR]
    grid = grid.view(rows, threads, _VECTOR)
    acc = torch.zeros(threads, _VECTOR, dtype=torch.float32)
    for row in grid:  # in the order each thread walks its vectors
        acc = acc + row
    tail = n % _VECTOR
    if tail:
        acc[:tail, 0] = acc[:tail, 0] + v[n - tail :]
    per_thread = ((acc[:, 0] + acc[:, 1]) + acc[:, 2]) + acc[:, 3]
    per_block = _tree_sum(per_thread.view(blocks, width))
    if blocks == 1:
        return per_block[0]
    staged = torch.zeros(width, dtype=torch.float32)
    for start in range(0, blocks, width):  # thread t of the last block adds results t, t + width, ...
        part = per_block[start : start + width]
        staged[: part.numel()] = staged[: part.numel()] + part
    return _tree_sum(staged.view(1, width))[0]


def _small_sum(v: torch.Tensor) -> torch.Tensor:
    n = v.numel()
    width = _floor_pow2(n)
    second = torch.zeros(width, dtype=torch.float32)
    second[: n - width] = v[width:]
    return _tree_sum((v[:width] + second).view(1, width))[0]


def cuda_mean(
    v: torch.Tensor,
    *,
    multiprocessors: int = HOPPER_MULTIPROCESSORS,
    threads_per_mp: int = HOPPER_THREADS_PER_MULTIPROCESSOR,
) -> torch.Tensor:
    """0-dim float32: what ``v.cuda().mean()`` returns for a non-empty 1-D float32 tensor ``v``."""
    v = v.to(torch.float32).reshape(-1)
    n = v.numel()
    if n == 0:
        raise ValueError("mean of an empty tensor")
    total = _vectorized_sum(v, multiprocessors, threads_per_mp) if n >= 128 else _small_sum(v)
    # MeanOps multiplies by factor = float(1) / n, computed in float32 on the host.
    factor = torch.tensor(1.0, dtype=torch.float32) / torch.tensor(float(n), dtype=torch.float32)
    return total * factor
