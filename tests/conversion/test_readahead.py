"""Read-ahead advice: in pieces Linux honours, covering exactly the bytes asked for, never past the window."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from prequant.conversion import readahead


def _advised(advice: list[tuple[int, int, int]]) -> int:
    return sum(n for _, n, how in advice if how == os.POSIX_FADV_WILLNEED)


def _wait_until_blocked(r: readahead.Readahead) -> None:
    """Until the read-ahead thread waits for the pipeline (or has finished): no deadline, a real state."""
    while r._thread.is_alive():
        frame = sys._current_frames().get(r._thread.ident)
        if frame is not None and frame.f_code.co_name == "wait" and "threading" in frame.f_code.co_filename:
            return
        time.sleep(0.01)


@pytest.fixture
def two_files(tmp_path) -> list[Path]:
    files = [tmp_path / "s0", tmp_path / "s1"]
    for f in files:
        f.write_bytes(b"\1" * (3 * readahead._STEP // 2))  # 96 MiB each: two steps per file
    return files


def test_background_readahead_stays_within_its_window(two_files, advice):
    window = readahead._STEP
    r = readahead.Readahead(two_files, window=window)
    _wait_until_blocked(r)
    assert _advised(advice) == window  # one window's worth, then it waits for the pipeline
    consumed = 0
    while r._thread.is_alive():  # the pipeline consumes what was read ahead, the read-ahead goes on
        advised = _advised(advice)
        r.consumed(advised - consumed)
        consumed = advised
        _wait_until_blocked(r)
        # Each step is advised only while it starts less than a window ahead of the pipeline.
        assert _advised(advice) - consumed < window + readahead._STEP
    assert _advised(advice) == 3 * readahead._STEP  # both files, each byte once


def test_background_readahead_skips_what_the_pipeline_already_consumed(two_files, advice):
    r = readahead.Readahead(two_files, window=readahead._STEP)
    _wait_until_blocked(r)
    first = len(advice)
    # A resume reports finished tensors at once: the rest of s0 and the first step of s1 are done already.
    r.consumed(readahead._STEP + readahead._STEP // 2 + readahead._STEP)
    r._thread.join()
    later = [(offset, n) for offset, n, how in advice[first:] if how == os.POSIX_FADV_WILLNEED]
    assert sum(n for _, n in later) == readahead._STEP // 2  # only s1's last 32 MiB
    assert all(offset >= readahead._STEP for offset, _ in later)


def test_start_reads_the_files_ahead_in_full_within_a_window_that_holds_them(two_files, advice):
    r = readahead.start(two_files, window=4 * readahead._STEP)
    assert r is not None and r.window == 4 * readahead._STEP
    r._thread.join()
    assert _advised(advice) == 3 * readahead._STEP  # each byte once


def test_start_without_a_window_takes_the_default_window_as_it_starts(two_files, monkeypatch):
    # The memory available moves with other processes, so the default is fixed here; its arithmetic is tested below.
    monkeypatch.setattr(readahead, "default_window", lambda: 5 * readahead._STEP)
    r = readahead.start(two_files)
    r.stop()
    r._thread.join()
    assert r.window == 5 * readahead._STEP


def test_default_window_is_a_quarter_of_the_memory_available_or_of_the_containers_room(monkeypatch):
    gib = 1024**3
    monkeypatch.setattr(readahead, "_available", lambda: 8 * gib)
    monkeypatch.setattr(readahead, "_cgroup_room", lambda: None)
    assert readahead.default_window() == 2 * gib
    monkeypatch.setattr(readahead, "_cgroup_room", lambda: 1 * gib)  # a container's limit leaves less
    assert readahead.default_window() == gib // 4
    monkeypatch.setattr(readahead, "_cgroup_room", lambda: 0)  # at its limit: one step, never nothing
    assert readahead.default_window() == readahead._STEP
    monkeypatch.setattr(readahead, "_available", lambda: None)  # no /proc/meminfo
    assert readahead.default_window() == 2 * 10**9


def test_available_memory_is_meminfos_memavailable(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemFree:         1000000 kB\nMemAvailable:    6000000 kB\n")
    assert readahead._available(meminfo) == 6000000 * 1024
    meminfo.write_text("MemTotal:       24000000 kB\n")  # a kernel without the field
    assert readahead._available(meminfo) is None
    assert readahead._available(tmp_path / "absent") is None
    if sys.platform == "linux":
        assert readahead._available() > 0  # this machine's own


def test_stop_asks_nothing_more(two_files, advice):
    r = readahead.start(two_files, window=readahead._STEP)
    _wait_until_blocked(r)
    r.stop()
    r._thread.join()
    assert _advised(advice) == readahead._STEP


def test_background_readahead_keeps_at_most_depth_bytes_asked_and_not_yet_read(two_files, monkeypatch):
    """A deep queue of advice makes every other read (a library page the imports fault in) wait behind it."""
    events: list[tuple[str, int, int]] = []
    real_fadvise, real_pread = os.posix_fadvise, os.pread

    def fadvise(fd: int, offset: int, length: int, how: int) -> None:
        if how == os.POSIX_FADV_WILLNEED:
            events.append(("ask", offset, length))
        real_fadvise(fd, offset, length, how)

    def pread(fd: int, n: int, offset: int) -> bytes:
        events.append(("wait", offset, n))
        return real_pread(fd, n, offset)

    monkeypatch.setattr(os, "posix_fadvise", fadvise)
    monkeypatch.setattr(os, "pread", pread)
    fd = os.open(two_files[0], os.O_RDONLY)
    chunk = readahead.advice_chunk(fd)
    os.close(fd)
    depth = 3 * chunk
    readahead.Readahead(two_files, window=10 * readahead._STEP, depth=depth)._thread.join()
    asked: list[tuple[int, int]] = []  # (end, bytes) of the current file's pieces not yet waited for
    worst, total, previous = 0, 0, -1
    for kind, offset, n in events:
        if kind == "ask":
            if offset < previous:  # the next file: the previous one was drained before it closed
                assert not asked
            previous = offset
            asked.append((offset + n, n))
            total += n
            worst = max(worst, sum(b for _, b in asked))
        else:
            asked = [(end, b) for end, b in asked if end > offset + 1]
    assert not asked  # every piece was waited for
    assert total == 3 * readahead._STEP and worst <= depth
    assert any(kind == "wait" for kind, _, _ in events)


def test_cgroup_room_is_what_the_memory_limit_leaves(tmp_path):
    """A container's page cache counts against its limit: reading ahead past it evicts what was just read."""
    proc = tmp_path / "cgroup"
    proc.write_text("0::/jobs/convert\n")
    group = tmp_path / "fs" / "jobs" / "convert"
    group.mkdir(parents=True)
    (group / "memory.current").write_text("268435456\n")
    (group / "memory.max").write_text("1073741824\n")
    assert readahead._cgroup_room(proc, tmp_path / "fs") == 1073741824 - 268435456
    (group / "memory.max").write_text("max\n")
    assert readahead._cgroup_room(proc, tmp_path / "fs") is None  # no limit
    proc.write_text("1:memory:/jobs/convert\n")  # cgroup v1 only: not read
    assert readahead._cgroup_room(proc, tmp_path / "fs") is None
