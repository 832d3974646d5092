"""bnb.kernels._parallel: the pool that runs the CPU kernel's and the statistics' block-aligned tasks.

What must hold whatever the thread count: every task runs exactly once, the bytes and statistics do not depend
on how many threads ran them, the first error comes back to the caller, and `run` returns only once no task
is running any more (a worker left running could read a memory map the caller is about to close).
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

import prequant
from prequant.bnb import stats
from prequant.bnb.kernels import _compare, _parallel, cpu


@pytest.fixture
def threads(monkeypatch):
    def use(n: int) -> None:
        monkeypatch.setattr(_parallel, "THREADS", n)

    return use


def test_every_task_runs_once_on_several_threads(threads):
    threads(4)
    seen, names = [], set()
    lock = threading.Lock()

    def work(i: int) -> None:
        time.sleep(0.001)
        with lock:
            seen.append(i)
            names.add(threading.current_thread().name)

    _parallel.run(200, work)
    assert sorted(seen) == list(range(200))
    assert len(names) > 1  # the caller and pool threads shared the work


def test_first_error_is_raised_after_every_started_task_finished(threads):
    threads(3)
    running = []
    lock = threading.Lock()

    def work(i: int) -> None:
        with lock:
            running.append(1)
        time.sleep(0.01)
        if i == 5:
            raise ValueError("task 5")
        with lock:
            running.pop()

    with pytest.raises(ValueError, match="task 5"):
        _parallel.run(1000, work)
    time.sleep(0.05)
    assert len(running) == 1  # only the failed task's own entry: nothing else still running, and no more started


def test_a_nested_call_runs_inline(threads):
    threads(2)
    inner = []

    def work(i: int) -> None:
        _parallel.run(3, lambda j: inner.append((i, j)))

    _parallel.run(4, work)
    assert sorted(inner) == [(i, j) for i in range(4) for j in range(3)]


def test_bytes_do_not_depend_on_the_thread_count(threads, monkeypatch):
    """Many tasks (small pieces), transposed input, odd length: 1 thread and 3 threads give the same bytes."""
    monkeypatch.setattr(cpu, "CHUNK_ELEMENTS", 4096)
    monkeypatch.setattr(cpu, "TASK_ELEMENTS", 4 * 4096)
    x = (torch.randn(301, 1777, generator=torch.Generator().manual_seed(2)) * 0.03).to(torch.bfloat16)
    results = {}
    for n in (1, 3):
        threads(n)
        for name, t in (("contiguous", x), ("transposed", x.t())):
            packed, absmax = cpu.quantize_4bit(t, quant_type="fp4", blocksize=64)
            results[n, name] = (packed, absmax, cpu.quantize_nested(absmax))
    for name in ("contiguous", "transposed"):
        (p1, a1, n1), (p3, a3, n3) = results[1, name], results[3, name]
        assert torch.equal(p1, p3) and torch.equal(a1, a3)
        assert torch.equal(n1[0], n3[0]) and torch.equal(n1[1], n3[1]) and n1[2] == n3[2]


def test_statistics_do_not_depend_on_the_thread_count(threads, monkeypatch):
    """The tasks' partial sums are added in task order: identical figures on 1 and 3 threads (here 12 tasks,
    which the threads finish in whatever order)."""
    monkeypatch.setattr(_compare, "TASK_ELEMENTS", 1 << 16)
    x = (torch.randn(700, 1031, generator=torch.Generator().manual_seed(3)) * 0.02).to(torch.bfloat16)
    entries = prequant.quantize_tensor(x)
    figures = []
    for n in (1, 3):
        threads(n)
        figures.append(stats.entry_stats(x, entries))
    assert figures[0] == figures[1] and figures[0].rel_error > 0


def test_pieces_grow_4x_per_doubling_of_the_threads_up_to_the_cap(threads):
    sizes = {}
    for n in (1, 2, 3, 4, 8, 16, 64):
        threads(n)
        sizes[n] = _parallel.task_elements(1 << 16, 1 << 20)
    assert sizes == {1: 1 << 16, 2: 1 << 18, 3: 1 << 20, 4: 1 << 20, 8: 1 << 20, 16: 1 << 20, 64: 1 << 20}


def test_default_pieces_differ_by_thread_count_and_give_the_same_bytes(threads):
    """Without a test's CHUNK_ELEMENTS the piece size follows the thread count (64 Ki on one thread, 1 Mi on
    three): an odd-length tensor of several large pieces quantizes to the same bytes either way."""
    x = (torch.randn(2_500_001, generator=torch.Generator().manual_seed(5)) * 0.05).to(torch.bfloat16)
    results, pieces = {}, {}
    for n in (1, 3):
        threads(n)
        pieces[n] = cpu._chunk_elements()
        packed, absmax = cpu.quantize_4bit(x, quant_type="nf4", blocksize=64)
        results[n] = (packed, absmax, cpu.quantize_nested(absmax))
    assert pieces == {1: 1 << 16, 3: 1 << 20}
    (p1, a1, n1), (p3, a3, n3) = results[1], results[3]
    assert torch.equal(p1, p3) and torch.equal(a1, a3)
    assert torch.equal(n1[0], n3[0]) and torch.equal(n1[1], n3[1]) and n1[2] == n3[2]


def test_thread_count_follows_torch(monkeypatch):
    monkeypatch.setattr(_parallel, "THREADS", None)
    assert _parallel.threads() == torch.get_num_threads()
