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


def test_start_after_stop_gives_a_running_readahead(two_files, advice):
    a = readahead.start(two_files)
    assert a is readahead.start(two_files)  # the CLI's early start is the one convert() continues
    a.stop()
    a._thread.join()
    before = _advised(advice)
    b = readahead.start(two_files)  # e.g. a second convert() of the same source in one process
    b._thread.join()
    assert b is not a and not b._stopped
    assert _advised(advice) - before == 3 * readahead._STEP  # it read the files ahead again, in full
    b.stop()


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


def test_the_clis_early_readahead_is_shallow_and_deepens_once_convert_takes_it_over(tmp_path, monkeypatch):
    """Shallow while the imports fault in library pages (they would wait behind it), deep once the pipeline runs."""
    library = tmp_path / "libtorch_cpu.so"
    library.write_bytes(b"\1" * (1 << 20))  # warm libraries (cold ones: the test below)
    monkeypatch.setattr(readahead, "_torch_library", lambda: library)
    (tmp_path / "model.safetensors").write_bytes(b"\1" * (3 * readahead._STEP // 2))
    readahead.start_for_source(str(tmp_path))
    early = readahead._current
    try:
        assert early is not None and early.depth == readahead.START_DEPTH
        assert readahead.start([tmp_path / "model.safetensors"]) is early  # what convert() does after planning
        assert early.depth == readahead.PIPELINE_DEPTH > readahead.START_DEPTH
    finally:
        early.stop()


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


def _evicted(path: Path, size: int) -> Path:
    """A file written, flushed and dropped from the page cache (as after `echo 3 > drop_caches`)."""
    path.write_bytes(os.urandom(size))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return path


def test_resident_fraction_is_the_share_of_the_file_in_the_page_cache(tmp_path):
    f = _evicted(tmp_path / "lib.so", 8 << 20)
    cold = readahead.resident_fraction(f)
    if cold is None or cold > 0.5:
        pytest.skip(f"this file system keeps pages DONTNEED asks to drop (resident {cold})")
    f.read_bytes()
    warm = readahead.resident_fraction(f)
    assert warm is not None and warm > 0.9 and cold <= 0.5


def test_an_early_readahead_beside_cold_libraries_waits_until_convert_sets_its_depth(two_files, advice, tmp_path,
                                                                                     monkeypatch):
    """Cold libraries are read fault by fault, each fault waiting behind the queued advice: the CLI's readahead
    then asks nothing (cold depth 0) until convert() takes it over with the pipeline's depth."""
    library = _evicted(tmp_path / "libtorch_cpu.so", 8 << 20)
    fraction = readahead.resident_fraction(library)
    if fraction is None or fraction > readahead.COLD_FRACTION:
        pytest.skip("this file system keeps pages DONTNEED asks to drop")
    monkeypatch.setattr(readahead, "_torch_library", lambda: library)
    monkeypatch.setattr(readahead, "_found_cold", False)  # what an earlier test of this process found
    r = readahead.Readahead(two_files, window=10 * readahead._STEP, depth=readahead.START_DEPTH, cold_depth=0)
    _wait_until_blocked(r)
    assert r.depth == 0 and _advised(advice) == 0
    assert readahead.found_libraries_cold()  # so convert() waits for CUDA before its pipeline (bnb.starting)
    r.set_depth(readahead.PIPELINE_DEPTH)
    r._thread.join()
    assert _advised(advice) == 3 * readahead._STEP


def test_an_early_readahead_beside_warm_libraries_keeps_its_start_up_depth(two_files, advice, tmp_path, monkeypatch):
    library = tmp_path / "libtorch_cpu.so"
    library.write_bytes(b"\1" * (1 << 20))  # just written: in the page cache
    monkeypatch.setattr(readahead, "_torch_library", lambda: library)
    monkeypatch.setattr(readahead, "_found_cold", False)
    # A cold depth that still reads (not 0), so that wrongly taking it shows as a wrong depth, not a hang.
    r = readahead.Readahead(two_files, window=10 * readahead._STEP, depth=readahead.START_DEPTH, cold_depth=1 << 20)
    r._thread.join()
    assert r.depth == readahead.START_DEPTH and _advised(advice) == 3 * readahead._STEP
    assert not readahead.found_libraries_cold()


def test_a_hub_source_s_cold_start_is_noted_without_a_readahead(tmp_path, monkeypatch):
    """The CLI asks for a Hub repo (no local files to read ahead): cold libraries are remembered, warm ones not."""
    warm = tmp_path / "warm.so"
    warm.write_bytes(b"\1" * (1 << 20))
    monkeypatch.setattr(readahead, "_torch_library", lambda: warm)
    monkeypatch.setattr(readahead, "_found_cold", False)
    assert not readahead.note_cold_start() and not readahead.found_libraries_cold()
    cold = _evicted(tmp_path / "libtorch_cpu.so", 8 << 20)
    fraction = readahead.resident_fraction(cold)
    if fraction is None or fraction > readahead.COLD_FRACTION:
        pytest.skip("this file system keeps pages DONTNEED asks to drop")
    monkeypatch.setattr(readahead, "_torch_library", lambda: cold)
    assert readahead.note_cold_start() and readahead.found_libraries_cold()
    assert readahead._current is None  # nothing read ahead


def test_the_cold_start_depth_can_be_set_for_a_benchmark(monkeypatch):
    monkeypatch.setenv(readahead.COLD_ENV, str(4 << 20))
    assert readahead.cold_start_depth() == 4 << 20
    monkeypatch.setenv(readahead.COLD_ENV, "four")
    assert readahead.cold_start_depth() == readahead.COLD_START_DEPTH


def test_the_pipeline_window_bounds_the_cpu_lead_and_can_be_set_for_a_benchmark(monkeypatch):
    monkeypatch.delenv(readahead.WINDOW_ENV, raising=False)
    start_up = readahead.default_window()
    assert readahead.pipeline_window("cpu") == min(readahead.PIPELINE_WINDOW["cpu"], start_up)
    assert abs(readahead.pipeline_window("cuda") - start_up) <= start_up // 10, "a GPU keeps the start-up's window"
    for device in ("cpu", "cuda"):
        monkeypatch.setenv(readahead.WINDOW_ENV, str(3 * readahead._STEP))
        assert readahead.pipeline_window(device) == 3 * readahead._STEP
        monkeypatch.setenv(readahead.WINDOW_ENV, "1")
        assert readahead.pipeline_window(device) == readahead._STEP, "never below one step"
        monkeypatch.setenv(readahead.WINDOW_ENV, str(10 * start_up))
        assert readahead.pipeline_window(device) <= start_up * 1.1, "never past the memory's bound"
        monkeypatch.setenv(readahead.WINDOW_ENV, "0")  # as far as the start-up's window
        assert abs(readahead.pipeline_window(device) - start_up) <= start_up // 10


def test_a_smaller_window_set_while_running_holds_the_advice_back(two_files, advice):
    """The pipeline's window, set on the read-ahead the CLI started: nothing more is asked until the pipeline has
    consumed its way back within it."""
    step = readahead._STEP
    r = readahead.Readahead(two_files, window=2 * step)
    _wait_until_blocked(r)
    assert _advised(advice) == 5 * step // 2  # s0 whole and s1's first step: 2.5 steps, started within 2
    r.set_window(step)
    r.consumed(step)  # 1.5 steps ahead: within the old window, past the new one
    time.sleep(0.2)  # the thread wakes to the news (else this could pass before it acted on the old window)
    _wait_until_blocked(r)
    assert _advised(advice) == 5 * step // 2
    r.consumed(step)  # half a step ahead: s1's last half step goes
    r._thread.join()
    assert _advised(advice) == 3 * step
