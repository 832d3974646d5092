"""Read-ahead advice: in pieces Linux honours, covering exactly the bytes asked for, never past the window."""

from __future__ import annotations

import os
import time

import pytest

from prequant import readahead


@pytest.fixture
def advice(monkeypatch) -> list[tuple[int, int, int]]:
    """Every posix_fadvise call as (offset, length, advice), the real call still made."""
    calls: list[tuple[int, int, int]] = []
    real = os.posix_fadvise

    def record(fd: int, offset: int, length: int, how: int) -> None:
        calls.append((offset, length, how))
        real(fd, offset, length, how)

    monkeypatch.setattr(os, "posix_fadvise", record)
    return calls


def test_advice_chunk_is_the_devices_readahead_or_the_default(tmp_path):
    f = tmp_path / "x"
    f.write_bytes(b"\0" * 10)
    fd = os.open(f, os.O_RDONLY)
    try:
        chunk = readahead.advice_chunk(fd)
    finally:
        os.close(fd)
    assert 128 * 1024 <= chunk <= 64 * 1024 * 1024 and chunk % 4096 == 0
    dev = os.stat(f).st_dev
    queue = f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/queue/read_ahead_kb"
    if os.path.exists(queue):  # a whole disk: exactly what its queue says (at least the kernel default)
        kb = max(int(open(queue).read()), int(open(queue.replace("read_ahead_kb", "max_sectors_kb")).read()))
        assert chunk == min(64 << 20, max(128 << 10, kb << 10))


@pytest.mark.parametrize("offset, length, chunk", [(0, 1, 4096), (100, 10_000, 4096), (0, 8 << 20, 1 << 20),
                                                   (5, (3 << 20) + 7, 1 << 20)])
def test_willneed_covers_the_range_in_pieces_no_larger_than_the_chunk(tmp_path, advice, offset, length, chunk):
    f = tmp_path / "x"
    f.write_bytes(b"\1" * (offset + length))
    fd = os.open(f, os.O_RDONLY)
    try:
        readahead.willneed(fd, offset, length, chunk)
    finally:
        os.close(fd)
    assert all(how == os.POSIX_FADV_WILLNEED and 0 < n <= chunk for _, n, how in advice)
    assert advice[0][0] == offset and sum(n for _, n, _ in advice) == length
    assert all(a[0] + a[1] == b[0] for a, b in zip(advice, advice[1:]))


def test_background_readahead_stays_within_its_window(tmp_path, advice):
    files = []
    for i in range(2):
        files.append(tmp_path / f"s{i}")
        files[-1].write_bytes(os.urandom(3 * readahead._STEP // 2))  # 96 MiB each: two steps per file
    r = readahead.Readahead(files, window=readahead._STEP)
    time.sleep(0.5)
    advised = sum(n for _, n, how in advice if how == os.POSIX_FADV_WILLNEED)
    assert advised == readahead._STEP  # one window's worth, then it waits for the pipeline
    r.consumed(3 * readahead._STEP)
    deadline = time.monotonic() + 10
    while sum(n for _, n, how in advice if how == os.POSIX_FADV_WILLNEED) < 3 * readahead._STEP:
        assert time.monotonic() < deadline, "readahead did not go on after the pipeline caught up"
        time.sleep(0.05)
    r.stop()
