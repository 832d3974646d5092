"""checkpoint.reader.TensorReader from several threads at once, as the GPU loader uses it (READ_THREADS parts of
one tensor read together): a shard is opened once, and releasing it leaves no descriptor on it.

The leak this guards against was measured on the GPU machine (2026-12-01): a Grok-shaped conversion from the
Hub with --delete-source-shards kept two evicted 4.8 GB shards open (three descriptors), waited 60 s for each
and overran its disk bound.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import torch
from safetensors.torch import save_file

from prequant.checkpoint.reader import TensorReader
from prequant.checkpoint.safetensors import read_header


def _descriptors_on(path: Path) -> int:
    target = str(path.resolve())
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}") == target
        except OSError:
            continue
    return count


def test_threads_reading_a_shard_at_once_open_it_once_and_release_closes_it(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file({"w": torch.arange(1 << 16, dtype=torch.float32)}, str(path))
    (ref,) = read_header(path)[0]
    for _ in range(20):  # a race: give it many chances
        reader = TensorReader()
        start = threading.Barrier(8)
        parts = [bytearray(4096) for _ in range(8)]

        threads = [threading.Thread(target=_read, args=(reader, ref, start, i, parts[i])) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert b"".join(parts) == path.read_bytes()[ref.offset : ref.offset + 8 * 4096]
        assert _descriptors_on(path) == 1
        view = reader.view(ref)  # the mapping reuses the descriptor
        assert torch.equal(view, torch.arange(1 << 16, dtype=torch.float32))
        del view
        reader.release(path)
        assert _descriptors_on(path) == 0


def _read(reader: TensorReader, ref, start: threading.Barrier, i: int, out: bytearray) -> None:
    start.wait()  # all threads ask for the shard's first bytes at once, as the GPU loader's do
    reader.read_into(ref, i * 4096, memoryview(out))
