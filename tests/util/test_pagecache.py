"""util.pagecache: read-ahead advice in pieces Linux honours, covering exactly the bytes asked for."""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import pytest

from prequant.util import pagecache


def test_advice_chunk_is_the_devices_readahead_or_the_default(tmp_path):
    f = tmp_path / "x"
    f.write_bytes(b"\0" * 10)
    fd = os.open(f, os.O_RDONLY)
    try:
        chunk = pagecache.advice_chunk(fd)
    finally:
        os.close(fd)
    dev = os.stat(f).st_dev
    block = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    queue = block / "queue" if (block / "queue").is_dir() else block.resolve().parent / "queue"  # a partition's disk
    if (queue / "read_ahead_kb").exists():
        kb = max(int((queue / "read_ahead_kb").read_text()), int((queue / "max_sectors_kb").read_text()))
        assert chunk == min(64 << 20, max(128 << 10, kb << 10))
    else:  # no block device behind the file (overlay, tmpfs): the kernel's default readahead
        assert chunk == 128 << 10


def test_whole_disk_is_the_disk_with_the_queue_settings(tmp_path):
    dev = os.stat(tmp_path).st_dev
    disk = pagecache.whole_disk(dev)
    if not Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}").exists():
        pytest.skip("no block device behind the temporary folder (overlay, tmpfs)")
    assert (disk / "queue" / "read_ahead_kb").is_file() and not (disk / "partition").exists()
    names = {line.split()[2] for line in Path("/proc/diskstats").read_text().splitlines()}
    assert disk.resolve().name in names


@pytest.mark.parametrize("offset, length, chunk", [(0, 1, 4096), (100, 10_000, 4096), (0, 8 << 20, 1 << 20),
                                                   (5, (3 << 20) + 7, 1 << 20)])
def test_pieces_cover_the_range_in_order_none_larger_than_the_chunk(offset, length, chunk):
    got = list(pagecache.pieces(offset, length, chunk))
    assert all(0 < n <= chunk for _, n in got)
    assert got[0][0] == offset and sum(n for _, n in got) == length
    assert all(a[0] + a[1] == b[0] for a, b in itertools.pairwise(got))


def test_will_need_advises_exactly_the_range_in_pieces_linux_reads_whole(tmp_path, advice):
    f = tmp_path / "x"
    f.write_bytes(os.urandom(3 << 20))
    fd = os.open(f, os.O_RDONLY)
    try:
        chunk = pagecache.advice_chunk(fd)
        pagecache.will_need(fd, 4096 + 5, (2 << 20) + 3)
        os.close(fd)
        pagecache.will_need(fd, 0, 10)  # a closed descriptor: advisory, nothing raised
    finally:
        try:
            os.close(fd)
        except OSError:
            pass
    advised = [(o, n) for o, n, how in advice if how == os.POSIX_FADV_WILLNEED]
    assert advised[:-1] == list(pagecache.pieces(4096 + 5, (2 << 20) + 3, chunk))
    assert all(n <= chunk for _, n in advised)
