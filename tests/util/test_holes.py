"""util.holes: a file's blocks given back to the disk while its size, and every byte outside the hole, stay."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from prequant.util import holes


def test_inner_takes_only_the_whole_blocks_of_a_range() -> None:
    assert holes.inner(0, 8192, 4096) == (0, 8192)
    assert holes.inner(544, 33312, 4096) == (4096, 32768)  # the blocks shared with the neighbours stay
    assert holes.inner(100, 4000, 4096) == (4096, 4096)  # no whole block: nothing
    assert holes.inner(4096, 8191, 4096) == (4096, 4096)


def test_punch_frees_the_blocks_keeps_the_size_and_the_bytes_around_it(tmp_path: Path) -> None:
    data = os.urandom(1 << 20)
    path = tmp_path / "shard"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDWR)
    try:
        os.fsync(fd)  # allocated for sure, not only delayed allocation
        before = os.fstat(fd).st_blocks * 512
        block = holes.block_size(fd)
        start, end = 1000, 700_000  # not block-aligned, as tensors are not
        try:
            freed = holes.punch(fd, start, end)
        except holes.Unsupported:
            pytest.skip(f"{tmp_path}'s filesystem cannot punch holes")
        first, last = holes.inner(start, end, block)
        assert freed == last - first > 0
        assert os.fstat(fd).st_size == len(data)
        assert before - os.fstat(fd).st_blocks * 512 >= freed  # given back to the disk
        now = path.read_bytes()
        assert now[:first] == data[:first] and now[last:] == data[last:]  # the neighbours' bytes are intact
        assert now[first:last] == bytes(last - first)  # the hole reads zeros
        assert holes.punch(fd, 10, 20) == 0  # inside one block: nothing to free
    finally:
        os.close(fd)
