"""What a tensor worker (`tensor_worker`) and its pool (`tensor_pool`) pass besides JSON: the ready byte, and a
tensor's entries in a memfd, which the pool maps, so that they cross without a copy."""

from __future__ import annotations

import mmap
import os

import numpy as np
import torch

from ..checkpoint.dtypes import SAFETENSORS_DTYPES, TORCH_TO_SAFETENSORS

READY = b"R"  # a worker's first message, once it has imported what it needs


def encode_entries(entries: dict[str, torch.Tensor]) -> tuple[int, list]:
    """(memfd, layout): the entries' bytes in a fresh memfd, and [key, dtype, shape, offset] for each."""
    layout, at = [], 0
    for key, t in entries.items():
        layout.append([key, TORCH_TO_SAFETENSORS[t.dtype], list(t.shape), at])
        at += -(-t.numel() * t.element_size() // 64) * 64
    fd = os.memfd_create("prequant-entries")
    try:
        os.ftruncate(fd, max(at, 1))
        with mmap.mmap(fd, max(at, 1)) as out:
            for (_, _, _, offset), t in zip(layout, entries.values()):
                raw = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
                np.frombuffer(out, np.uint8, raw.size, offset)[:] = raw
    except BaseException:
        os.close(fd)
        raise
    return fd, layout


def decode_entries(fd: int, layout: list) -> dict[str, torch.Tensor]:
    """The entries `encode_entries` wrote, as tensors viewing this process' map of the memfd (closed here)."""
    try:
        size = os.fstat(fd).st_size
        # Populated at once: page by page, the writer's pwrite from this map faulted 4 KiB at a time and took twice
        # as long (7.5 s against 3.9 s for a 16 GB Llama on the GPU machine, 2026-12-02).
        memory = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
    finally:
        os.close(fd)
    out = {}
    for key, code, shape, offset in layout:
        dtype = SAFETENSORS_DTYPES[code]
        count = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        out[key] = torch.from_numpy(np.frombuffer(memory, np.uint8, count, offset)).view(dtype).view(shape)
    return out
