"""bnb.kernels._procs / _worker: the CPU kernel and its statistics on worker processes.

Real worker processes (two of them), with chunks small enough that every tensor here crosses several chunks
and every worker gets more chunks than it has slots. What must hold: the bytes are the CUDA golden bytes and
the thread pool's, the statistics are the thread pool's numbers, a mapped source is read by the workers from
its file (and a replaced or deleted file is not), NaN/Inf is refused as on the threads, and a worker that
dies or an interrupt never costs a result: the tensor is redone on the threads, or the workers are killed.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from conftest import DATA
from safetensors.torch import save_file

import prequant
from prequant.bnb import stats
from prequant.bnb.kernels import _compare, _parallel, _procs, _wire, cpu
from prequant.checkpoint.reader import TensorReader
from prequant.checkpoint.safetensors import read_header

CHUNK = 1 << 14  # elements per chunk here (the default is 1 Mi)


@pytest.fixture(scope="module")
def workers():
    """Two workers with small chunks; the statistics' tasks shrink with them (both paths use the same ones)."""
    saved = (_procs.PROCESSES, _procs.MIN_ELEMENTS, _procs.CHUNK, _compare.TASK_ELEMENTS)
    _procs.close()
    _procs.PROCESSES, _procs.MIN_ELEMENTS, _procs.CHUNK, _compare.TASK_ELEMENTS = 2, 1 << 12, CHUNK, CHUNK
    yield
    _procs.close()
    _procs.PROCESSES, _procs.MIN_ELEMENTS, _procs.CHUNK, _compare.TASK_ELEMENTS = saved


def _pool() -> _procs.Pool:
    _procs._failures = 0  # several tests here break their pool on purpose
    pool = _procs.pool_for(1 << 30, wait=True)
    assert pool is not None, "the worker processes did not start"
    return pool


def _on_threads(fn, *args, **kwargs):
    saved, _procs.PROCESSES = _procs.PROCESSES, 0
    try:
        return fn(*args, **kwargs)
    finally:
        _procs.PROCESSES = saved


def _on_workers(fn, *args, chunks: int, **kwargs):
    """fn(*args) with the workers, which must have done exactly `chunks` chunks of it."""
    pool = _pool()
    before = pool.chunks
    out = fn(*args, **kwargs)
    assert pool.chunks - before == chunks
    return out


def _kernel_chunks(n: int, blocksize: int) -> int:
    """Chunks of the kernel for n elements on the 2 workers: whole rounds (an even count of at most CHUNK
    elements each, whole blocks), fewer only where a blocksize-rounded chunk covers more."""
    count = -(-n // CHUNK)
    count += count % 2
    step = -(-n // count)
    step = -(-step // blocksize) * blocksize
    return -(-n // step)


def _golden_cases() -> list[str]:
    from safetensors import safe_open

    with safe_open(DATA / "golden.safetensors", "pt") as f:
        return sorted(json.loads(f.metadata()["cases"]))


@pytest.mark.parametrize("case", _golden_cases())
def test_golden_bytes_equal_cuda_on_the_workers(workers, case):
    from safetensors import safe_open

    with safe_open(DATA / "golden.safetensors", "pt") as f:
        meta = json.loads(f.metadata()["cases"])[case]
        x = f.get_tensor(case.split("/")[0] + "/input")
        want = f.get_tensor(case + "/weight").view(-1)
        want_absmax = f.get_tensor(case + "/absmax")
    if x.numel() < _procs.MIN_ELEMENTS:
        pytest.skip(f"{x.numel()} elements: the threads' business")
    packed, absmax = _on_workers(cpu.quantize_4bit, x, quant_type=meta["quant_type"], blocksize=meta["blocksize"],
                                 chunks=_kernel_chunks(x.numel(), meta["blocksize"]))  # fmt: skip
    assert torch.equal(packed, want)
    if "nested_offset" not in meta:
        assert torch.equal(absmax, want_absmax)
    else:
        assert torch.equal(cpu.quantize_nested(absmax, blocksize=meta["nested_blocksize"])[0], want_absmax)


CASES = [  # shape, dtype, quant type, blocksize: odd sizes end in a partial block and an odd element
    ((301, 517), torch.bfloat16, "nf4", 64),
    ((257, 1001), torch.float16, "fp4", 128),
    ((96, 1024), torch.float32, "nf4", 4096),
    ((3, 40001), torch.bfloat16, "fp4", 256),
]


@pytest.mark.parametrize("transposed", [False, True], ids=["contiguous", "transposed"])
@pytest.mark.parametrize(("shape", "dtype", "quant_type", "blocksize"), CASES)
def test_bytes_and_statistics_equal_the_threads(workers, shape, dtype, quant_type, blocksize, transposed):
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(*shape, generator=g) * 0.02).to(dtype)
    x[0, :70] = 0  # a zero block
    x = x.t() if transposed else x
    want = _on_threads(cpu.quantize_4bit, x, quant_type=quant_type, blocksize=blocksize)
    got = _on_workers(cpu.quantize_4bit, x, quant_type=quant_type, blocksize=blocksize,
                      chunks=_kernel_chunks(x.numel(), blocksize))  # fmt: skip
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    entries = prequant.quantize_tensor(x, quant_type=quant_type, blocksize=blocksize)
    # Statistics: the dequantized absmax is computed on the threads, the sums on the workers, in the threads'
    # tasks (whole blocks of at most CHUNK elements).
    want_stats = _on_threads(stats.entry_stats, x, entries)
    tasks = -(-x.numel() // max(blocksize, CHUNK // blocksize * blocksize))
    assert _on_workers(stats.entry_stats, x, entries, chunks=tasks) == want_stats


def test_tiny_values_give_the_threads_statistics(workers):
    """Values near float32's smallest normal take the scaled path of the sums (`exponent`)."""
    x = (torch.randn(200, 300, generator=torch.Generator().manual_seed(3)) * 1e-36).to(torch.float32)
    entries = prequant.quantize_tensor(x, double_quant=False)
    want = _on_threads(stats.entry_stats, x, entries)
    assert _on_workers(stats.entry_stats, x, entries, chunks=-(-x.numel() // CHUNK)) == want
    assert want.rel_error > 0


def _mapped(tmp_path, tensors: dict[str, torch.Tensor]):
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path))
    reader = TensorReader()
    return path, reader, {ref.name: reader.view(ref) for ref in read_header(path)[0]}


def test_a_mapped_source_is_read_by_the_workers_from_its_file(workers, tmp_path):
    x = (torch.randn(300, 411, generator=torch.Generator().manual_seed(1)) * 0.02).to(torch.bfloat16)
    path, reader, views = _mapped(tmp_path, {"a": torch.ones(7), "w": x})
    with reader:
        origin = _wire.file_origin(views["w"])
        assert origin is not None and origin.path == os.fsencode(path)
        with open(path, "rb") as f:  # the offset is that of the tensor's bytes in the file
            f.seek(origin.offset)
            assert f.read(x.numel() * 2) == x.view(torch.int16).numpy().tobytes()
        got = _on_workers(cpu.quantize_4bit, views["w"], quant_type="nf4", blocksize=64,
                          chunks=_kernel_chunks(x.numel(), 64))  # fmt: skip
        want = _on_threads(cpu.quantize_4bit, x, quant_type="nf4", blocksize=64)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        entries = prequant.quantize_tensor(x)
        want_stats = stats.entry_stats(x, entries)
        assert _on_workers(stats.entry_stats, views["w"], entries, chunks=-(-x.numel() // CHUNK)) == want_stats
    assert _wire.file_origin(x) is None  # anonymous memory: copied into the slots


def test_a_replaced_or_deleted_source_file_is_not_read_by_the_workers(workers, tmp_path):
    x = (torch.randn(100, 500, generator=torch.Generator().manual_seed(2)) * 0.02).to(torch.bfloat16)
    path, reader, views = _mapped(tmp_path, {"w": x})
    with reader:
        save_file({"w": torch.zeros_like(x)}, str(tmp_path / "other.safetensors"))
        os.replace(tmp_path / "other.safetensors", path)  # the path now names another file (zeros)
        assert _wire.file_origin(views["w"]) is None
        got = _on_workers(cpu.quantize_4bit, views["w"], quant_type="nf4", blocksize=64,
                          chunks=_kernel_chunks(x.numel(), 64))  # fmt: skip
        assert torch.equal(got[0], _on_threads(cpu.quantize_4bit, x, quant_type="nf4", blocksize=64)[0])
        os.unlink(path)
        assert _wire.file_origin(views["w"]) is None


def test_a_renamed_source_file_is_read_by_the_workers_under_its_new_name(workers, tmp_path):
    """A Hub shard set aside while it is freed (`hub.client.set_aside`) is renamed under the mapping: the workers
    find it by its new name, the same file."""
    x = (torch.randn(100, 500, generator=torch.Generator().manual_seed(3)) * 0.02).to(torch.bfloat16)
    path, reader, views = _mapped(tmp_path, {"w": x})
    with reader:
        aside = path.with_name(f"{path.name}.prequant-freeing")
        os.replace(path, aside)
        origin = _wire.file_origin(views["w"])
        assert origin is not None and origin.path == os.fsencode(aside)
        got = _on_workers(cpu.quantize_4bit, views["w"], quant_type="nf4", blocksize=64,
                          chunks=_kernel_chunks(x.numel(), 64))  # fmt: skip
        want = _on_threads(cpu.quantize_4bit, x, quant_type="nf4", blocksize=64)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_a_worker_checks_the_file_is_the_one_mapped(workers, tmp_path):
    """Between this process' check and the worker's read the file may be replaced: the worker refuses it."""
    x = torch.randn(64, 1024).to(torch.bfloat16)
    _, reader, views = _mapped(tmp_path, {"w": x})
    with reader:
        origin = _wire.file_origin(views["w"])
        pool = _pool()
        wrong = origin._replace(inode=origin.inode + 1)

        def fill(i: int, slot: int) -> bytes:
            return _wire.request(_wire.QUANTIZE, torch.bfloat16, 0, slot, CHUNK, 64, 0, wrong, i * CHUNK * 2)

        with pytest.raises(_procs.Unavailable):
            pool.run(4, fill, lambda i, slot, sums: None)
        assert pool.broken
    assert _pool() is not pool  # the next large tensor gets a fresh pool


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_input_raises_and_the_pool_goes_on(workers, bad):
    x = torch.randn(100, 1000).to(torch.bfloat16)
    x[60, 7] = bad  # in the fourth of seven chunks
    pool = _pool()
    with pytest.raises(cpu.NonFiniteError):
        cpu.quantize_4bit(x, quant_type="nf4", blocksize=64)
    assert not pool.broken
    x[60, 7] = 0
    _on_workers(cpu.quantize_4bit, x, quant_type="nf4", blocksize=64, chunks=_kernel_chunks(x.numel(), 64))
    assert _pool() is pool


def test_a_worker_that_dies_costs_no_result(workers, caplog):
    x = (torch.randn(200, 1000, generator=torch.Generator().manual_seed(4)) * 0.02).to(torch.bfloat16)
    pool = _pool()
    procs = list(pool._procs)
    os.kill(pool._procs[1].pid, signal.SIGKILL)
    pool._procs[1].wait()
    with caplog.at_level(logging.WARNING, logger="prequant.bnb.kernels.cpu"):
        got = cpu.quantize_4bit(x, quant_type="nf4", blocksize=64)
    want = _on_threads(cpu.quantize_4bit, x, quant_type="nf4", blocksize=64)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert "worker processes stopped" in caplog.text and "quantizing on threads" in caplog.text
    assert pool.broken and all(p.poll() is not None for p in procs)  # the other worker was ended too
    assert _pool() is not pool


def test_an_interrupt_kills_the_workers(workers):
    pool = _pool()
    procs = list(pool._procs)

    def fill(i: int, slot: int) -> bytes:
        if i == 5:
            raise KeyboardInterrupt
        return _wire.request(_wire.QUANTIZE, torch.bfloat16, 0, slot, CHUNK, 64)

    with pytest.raises(KeyboardInterrupt):
        pool.run(20, fill, lambda i, slot, sums: None)
    assert pool.broken and all(p.poll() is not None for p in procs)


def test_workers_ignore_sigint_and_end_when_their_stdin_closes(workers):
    pool = _pool()
    procs = list(pool._procs)
    for p in procs:
        os.kill(p.pid, signal.SIGINT)  # a Ctrl-C reaches the whole process group: the parent decides
    time.sleep(0.3)
    assert all(p.poll() is None for p in procs)
    _procs.close()
    assert all(p.poll() is not None for p in procs)


def test_small_tensors_and_busy_pools_use_the_threads(workers):
    assert _procs.pool_for(_procs.MIN_ELEMENTS - 1) is None
    pool = _pool()
    with pool.busy:  # another thread's tensor is on the workers
        with pytest.raises(_procs.Unavailable):
            pool.run(1, lambda i, slot: b"", lambda i, slot, sums: None)
        x = torch.randn(100, 1000).to(torch.bfloat16)
        before = pool.chunks
        got = cpu.quantize_4bit(x, quant_type="nf4", blocksize=64)
        assert pool.chunks == before and not pool.broken
    assert torch.equal(got[0], _on_threads(cpu.quantize_4bit, x, quant_type="nf4", blocksize=64)[0])


def test_worker_count(monkeypatch, caplog):
    monkeypatch.setattr(_procs, "PROCESSES", None)
    monkeypatch.delenv(_procs.ENV, raising=False)
    monkeypatch.setattr(_procs, "_memory_available", lambda: 64 * 2**30)
    monkeypatch.setattr(_parallel, "THREADS", 16)
    assert _procs.workers() == 0  # not asked: the threads
    monkeypatch.setenv(_procs.ENV, "3")
    assert _procs.workers() == 3
    monkeypatch.setenv(_procs.ENV, "0")
    assert _procs.workers() == 0
    monkeypatch.setenv(_procs.ENV, "auto")
    assert _procs.workers() == 16  # one per thread
    monkeypatch.setattr(_procs, "_memory_available", lambda: 6 * 8 * _procs.WORKER_BYTES)
    assert _procs.workers() == 6  # as many as an eighth of the available memory holds
    monkeypatch.setattr(_procs, "_memory_available", lambda: 3 * 8 * _procs.WORKER_BYTES)
    assert _procs.workers() == 0  # too few to pay
    monkeypatch.setattr(_procs, "_memory_available", lambda: 64 * 2**30)
    monkeypatch.setattr(_parallel, "THREADS", _procs.AUTO_MIN - 1)
    assert _procs.workers() == 0  # few cores: the threads
    monkeypatch.setenv(_procs.ENV, "many")
    with caplog.at_level(logging.WARNING, logger="prequant.bnb.kernels._procs"):
        assert _procs.workers() == 0
    assert "PREQUANT_CPU_PROCESSES='many'" in caplog.text
    monkeypatch.undo()
    assert _procs._memory_available() > 2**20  # the real figure, from /proc/meminfo


def test_a_conversion_process_with_workers_exits_cleanly_without_leaving_them(checkpoints, tmp_path):
    """A `prequant convert` process given PREQUANT_CPU_PROCESSES=2 quantizes on its workers (its trace has their
    timings), writes the threads' bytes, exits 0 and leaves no worker behind. The tiny model's tensors reach the
    workers only through a small MIN_ELEMENTS and a pool started first (a long conversion's pool is ready after
    its first seconds), which only a test sets: hence the -c."""
    from conftest import cli_env

    src, trace_file = checkpoints("llama"), tmp_path / "trace.json"
    code = ("import sys; from prequant.bnb.kernels import _procs; _procs.MIN_ELEMENTS = 1 << 12; "
            "pool = _procs.pool_for(1 << 40, wait=True); print('workers', *[p.pid for p in pool._procs], "
            "file=sys.stderr, flush=True); from prequant.__main__ import main; sys.argv[0] = 'prequant'; main()")  # fmt: skip
    pids: list[int] = []
    for name, processes in (("threads", "0"), ("workers", "2")):
        env = cli_env({_procs.ENV: processes, "PREQUANT_TRACE": str(trace_file)})
        if processes == "0":  # no pool to start first
            run = ["-m", "prequant"]
        else:
            run = ["-c", code]
        done = subprocess.run([sys.executable, *run, "convert", str(src), str(tmp_path / name), "--device", "cpu"],
                              env=env, capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
        assert done.returncode == 0, done.stderr
        busy = json.loads(trace_file.read_text())["busy"]
        assert ("cpu-workers-wall" in busy) == (processes != "0")
        pids += [int(v) for line in done.stderr.splitlines() if line.startswith("workers ") for v in line.split()[1:]]
    assert len(pids) == 2
    for pid in pids:  # killed at exit (and reaped by init): gone
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    for shard in sorted(p.name for p in (tmp_path / "threads").glob("*.safetensors")):
        assert (tmp_path / "threads" / shard).read_bytes() == (tmp_path / "workers" / shard).read_bytes()


def test_a_conversion_on_the_workers_writes_the_threads_bytes(workers, checkpoints, tmp_path):
    src = checkpoints("llama")
    _on_threads(prequant.convert, src, tmp_path / "threads", device="cpu", progress=False)
    pool = _pool()
    before = pool.chunks
    prequant.convert(src, tmp_path / "workers", device="cpu", progress=False)
    assert pool.chunks > before
    names = sorted(p.name for p in (tmp_path / "threads").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "workers").iterdir())
    for name in names:
        if name.endswith(".safetensors"):
            assert (tmp_path / "threads" / name).read_bytes() == (tmp_path / "workers" / name).read_bytes(), name
    manifests = [json.loads((tmp_path / d / "prequant.json").read_text()) for d in ("threads", "workers")]
    assert manifests[0]["tensors"] == manifests[1]["tensors"]  # the same statistics


def test_after_repeated_worker_failures_the_threads_take_over(workers):
    for _ in range(_procs.MAX_FAILURES):
        pool = _procs.pool_for(1 << 30, wait=True)
        assert pool is not None
        os.kill(pool._procs[0].pid, signal.SIGKILL)
        pool._procs[0].wait()
        x = torch.randn(100, 1000).to(torch.bfloat16)
        cpu.quantize_4bit(x, quant_type="nf4", blocksize=64)  # redone on the threads
        assert pool.failed
    assert _procs.pool_for(1 << 30, wait=True) is None
    _procs._failures = 0


def test_the_kernel_gives_every_worker_as_many_chunks(workers):
    """5.5 chunks' worth of elements go as 6 nearly equal chunks (3 per worker), not 5 full ones and a half."""
    pool = _pool()
    sizes: list[int] = []
    real_run = pool.run

    def run(count, fill, collect):
        def spy(i, slot):
            request = fill(i, slot)
            sizes.append(_wire.REQUEST.unpack(request[: _wire.REQUEST.size])[4])
            return request

        return real_run(count, spy, collect)

    pool.run = run
    try:
        cpu.quantize_4bit(torch.randn(11, CHUNK // 2).to(torch.bfloat16), quant_type="nf4", blocksize=64)
    finally:
        del pool.run
    assert len(sizes) == 6 and sum(sizes) == 11 * CHUNK // 2 and len(set(sizes[:-1])) == 1
    assert 0 <= sizes[0] - sizes[-1] < 6 * 64  # the first ones rounded up to whole blocks, the last one less


def test_threads_asking_for_a_starting_pool_at_once_all_get_it(workers, monkeypatch):
    """Readiness is read by one thread at a time: two threads reading one worker's ready byte at once left the
    second blocked on a pipe that would never speak again. A slower `select` (50 ms more) holds the window
    open that a loaded machine opens by chance."""
    real_select = _procs.select.select

    def slow_select(*args):
        ready = real_select(*args)
        time.sleep(0.05)
        return ready

    _procs.close()
    _procs._failures = 0
    monkeypatch.setattr(_procs.select, "select", slow_select)
    got: list[object] = []
    errors: list[BaseException] = []
    start = threading.Barrier(8)

    def ask() -> None:
        start.wait()
        try:
            while (pool := _procs.pool_for(1 << 30)) is None:
                pass
        except BaseException as e:  # noqa: BLE001 - e.g. two threads removing the same worker from the list
            errors.append(e)
            return
        got.append(pool)

    threads = [threading.Thread(target=ask, daemon=True) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads), "a thread is stuck waiting for a worker"
    assert errors == []
    assert len(got) == 8 and len({id(p) for p in got}) == 1
