"""bnb.tensor_pool / tensor_worker: whole tensors quantized on worker processes.

Real worker processes (two of them) reading real safetensors files. What must hold: a worker's entries are the
bytes, dtypes and shapes the conversion's own process computes, and its statistics the same numbers; what a
worker cannot take (anonymous memory, small tensors) is refused before it is sent; a tensor the worker fails on
(NaN, a file replaced since it was mapped) comes back as None with the pool still whole; a worker that dies costs
no result; and a conversion on the workers writes the bytes and the manifest of one without them.
"""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch
from safetensors.torch import save_file

import prequant
from prequant.bnb import stats, tensor_pool, tensor_spawn
from prequant.bnb.format import Settings, entry_key
from prequant.bnb.quantize import Quantizer
from prequant.checkpoint.reader import TensorReader
from prequant.checkpoint.safetensors import read_header
from prequant.util import memory


@pytest.fixture()
def pool():
    """Two ready workers that take tensors from 4096 elements and conversions of any size."""
    saved = (tensor_pool.COUNT, tensor_pool.MIN_ELEMENTS, tensor_spawn.MIN_BYTES, tensor_pool._failures)
    tensor_pool.close()
    tensor_pool.COUNT, tensor_pool.MIN_ELEMENTS, tensor_spawn.MIN_BYTES, tensor_pool._failures = 2, 1 << 12, 0, 0
    started = tensor_pool.pool()
    assert started is not None and started.wait_ready(), "the workers did not start"
    yield started
    tensor_pool.close()
    tensor_pool.COUNT, tensor_pool.MIN_ELEMENTS, tensor_spawn.MIN_BYTES, tensor_pool._failures = saved


def _without_workers(src, out) -> None:
    """A conversion in this process alone (the pool is closed for it); then a fresh pool, ready."""
    tensor_pool.COUNT = 0
    prequant.convert(src, out, device="cpu", progress=False)
    tensor_pool.COUNT = 2
    assert tensor_pool.pool().wait_ready()


def _mapped(tmp_path, tensors: dict[str, torch.Tensor]):
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path))
    reader = TensorReader()
    return path, reader, {ref.name: reader.view(ref) for ref in read_header(path)[0]}


CASES = [  # shape, dtype, settings: odd sizes end in a partial block and an odd element
    ((301, 517), torch.bfloat16, Settings("nf4", True, 64, "bfloat16", "uint8")),
    ((257, 1001), torch.float16, Settings("fp4", True, 128, "float16", "bfloat16")),
    ((96, 1024), torch.float32, Settings("nf4", False, 4096, "float32", "float32")),
    ((3, 40001), torch.bfloat16, Settings("fp4", False, 256, "bfloat16", "float16")),
]


@pytest.mark.parametrize("transpose", [False, True], ids=["as-is", "transposed"])
@pytest.mark.parametrize(("shape", "dtype", "settings"), CASES)
def test_entries_and_statistics_equal_this_process(pool, tmp_path, shape, dtype, settings, transpose):
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(*shape, generator=g) * 0.02).to(dtype)
    x[0, :70] = 0  # a zero block
    _, reader, views = _mapped(tmp_path, {"small": torch.ones(3), "w": x})
    with reader:
        job = pool.take(views["w"], "w", settings, True, transpose)
        assert job is not None, "a mapped tensor of enough elements goes to a ready worker"
        pool.wait(job)
        if transpose:  # as a Conv1D weight is quantized: its transpose, not contiguous
            x = x.t()
        want = Quantizer(settings, torch.device("cpu"))(x, "w")
        assert job.entries is not None and list(job.entries) == list(want)
        for key, tensor in want.items():
            got = job.entries[key]
            assert (got.dtype, got.shape) == (tensor.dtype, tensor.shape), key
            assert torch.equal(got.view(torch.uint8), tensor.view(torch.uint8)), key
        assert job.stats == stats.entry_stats(x, want)
        pool.release(job)
    assert pool.held == 0 and pool.tensors == 1 and not pool.busy()


def test_what_a_worker_cannot_take_is_refused_before_it_is_sent(pool, tmp_path):
    settings = Settings()
    x = torch.randn(64, 128).to(torch.bfloat16)
    assert pool.take(x, "anonymous", settings, True) is None  # not a mapped file's bytes
    _, reader, views = _mapped(tmp_path, {"small": torch.randn(16, 64), "w": x, "i": torch.ones(8192, dtype=torch.int32)})
    with reader:
        assert pool.take(views["small"], "small", settings, True) is None  # under MIN_ELEMENTS
        assert pool.take(views["i"], "i", settings, True) is None  # not a float
        assert pool.take(views["w"].t(), "strided", settings, True) is None  # not the file's bytes as they lie
    assert not pool.busy() and pool.tensors == 0


def test_the_pool_holds_no_more_than_its_memory_budget(pool, tmp_path):
    x = torch.randn(64, 128).to(torch.bfloat16)
    _, reader, views = _mapped(tmp_path, {"a": x, "b": x + 1})
    pool.budget = int(x.numel() * tensor_pool.BYTES_PER_ELEMENT) + 1
    with reader:
        first = pool.take(views["a"], "a", Settings(), False)
        assert first is not None
        assert pool.take(views["b"], "b", Settings(), False) is None, "a second tensor would pass the budget"
        pool.wait(first)
        assert first.stats is None  # not asked for
        pool.release(first)
        second = pool.take(views["b"], "b", Settings(), False)
        assert second is not None and pool.wait(second).entries is not None


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_tensor_the_worker_fails_on_comes_back_empty_and_the_pool_goes_on(pool, tmp_path, bad):
    x = torch.randn(64, 128)
    x[5, 7] = bad
    _, reader, views = _mapped(tmp_path, {"w": x.to(torch.bfloat16)})
    with reader:
        job = pool.wait(pool.take(views["w"], "w", Settings(), True))
        assert job.entries is None and job.stats is None
        with pytest.raises(prequant.PrequantError, match="NaN or Inf"):  # what the caller then raises
            Quantizer(Settings(), torch.device("cpu"))(views["w"], "w")
    assert not pool.broken


def test_a_worker_checks_the_file_is_the_one_mapped(pool, tmp_path):
    x = torch.randn(64, 128).to(torch.bfloat16)
    path, reader, views = _mapped(tmp_path, {"w": x})
    with reader:
        replacement = tmp_path / "other.safetensors"
        save_file({"w": x + 1}, str(replacement))
        job = pool.take(views["w"], "w", Settings(), True)  # the request names the mapped file's inode
        os.replace(replacement, path)
        # The worker may have read the file before the replace (then its bytes are the mapped ones): either the
        # mapped bytes or nothing, never the replacement's.
        pool.wait(job)
        if job.entries is not None:
            want = Quantizer(Settings(), torch.device("cpu"))(x, "w")
            # bytes, not values: packed codes viewed as bf16 storage hold NaN patterns (NaN != NaN)
            assert torch.equal(job.entries["weight"].view(torch.uint8), want["weight"].view(torch.uint8))
        later = pool.take(views["w"], "w", Settings(), True)
        assert later is None or pool.wait(later).entries is None  # the mapping's file is gone from its path
    assert not pool.broken


def test_a_worker_that_dies_costs_no_result(pool, tmp_path, caplog):
    x = torch.randn(64, 128).to(torch.bfloat16)
    _, reader, views = _mapped(tmp_path, {"a": x, "b": x * 2})
    with reader:
        jobs = [pool.take(views[k], k, Settings(), True) for k in "ab"]
        assert None not in jobs
        for w in pool._workers:
            os.kill(w.proc.pid, signal.SIGKILL)
        for job in jobs:
            pool.wait(job)  # answered, not hung: the caller redoes what came back empty
    assert pool.broken and pool.failed and "ended" in caplog.text
    assert tensor_pool.pool() is not pool, "a broken pool is replaced"


def test_workers_end_with_their_pool(pool):
    procs = [w.proc for w in pool._workers]
    tensor_pool.close()
    assert all(p.poll() is not None for p in procs)


def test_worker_count(monkeypatch):
    monkeypatch.setattr(tensor_pool, "COUNT", None)
    monkeypatch.setenv(tensor_pool.ENV, "3")
    assert tensor_pool.workers() == 3
    monkeypatch.setenv(tensor_pool.ENV, "0")
    assert tensor_pool.workers() == 0
    monkeypatch.setenv(tensor_pool.ENV, "auto")
    from prequant.bnb.kernels import _parallel

    monkeypatch.setattr(_parallel, "THREADS", tensor_spawn.AUTO_MIN - 1)
    assert tensor_pool.workers() == 0, "too few cores for workers to pay"
    monkeypatch.setattr(_parallel, "THREADS", tensor_spawn.AUTO_MIN)
    assert tensor_pool.workers() == tensor_spawn.AUTO_MIN  # this machine's memory holds four
    monkeypatch.delenv(tensor_pool.ENV)
    assert tensor_pool.workers() == tensor_spawn.AUTO_MIN, "auto is the default"
    monkeypatch.setattr(memory, "available", lambda: 8 * tensor_spawn.WORKER_BYTES * tensor_spawn.AUTO_MIN - 1)
    assert tensor_pool.workers() == 0, "an eighth of the memory must hold them"
    monkeypatch.setattr(tensor_spawn, "MIN_BYTES", 10**9)
    assert tensor_pool.pool(10**9 - 1) is None, "a small conversion starts no workers"


@pytest.mark.parametrize("kind", ["llama", "gpt2"])  # gpt2: Conv1D weights, quantized transposed
def test_a_conversion_on_the_workers_writes_the_same_bytes_and_statistics(pool, checkpoints, tmp_path, kind):
    src = checkpoints(kind)
    _without_workers(src, tmp_path / "here")
    pool = tensor_pool.pool()
    procs = [w.proc for w in pool._workers]
    prequant.convert(src, tmp_path / "workers", device="cpu", progress=False)
    assert pool.tensors > 0 and pool.held == 0 and not pool.busy()
    assert tensor_pool._pool is None and all(p.poll() is not None for p in procs), "the workers end with convert()"
    names = sorted(p.name for p in (tmp_path / "here").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "workers").iterdir())
    for name in names:
        if name.endswith(".safetensors"):
            assert (tmp_path / "here" / name).read_bytes() == (tmp_path / "workers" / name).read_bytes(), name
    manifests = [json.loads((tmp_path / d / "prequant.json").read_text()) for d in ("here", "workers")]
    assert manifests[0]["tensors"] == manifests[1]["tensors"]
    assert manifests[0]["stats"] == manifests[1]["stats"] and manifests[0]["stats"]["complete"]


def test_a_conversion_whose_workers_die_writes_the_same_bytes(pool, checkpoints, tmp_path):
    src = checkpoints("llama")
    _without_workers(src, tmp_path / "here")
    pool = tensor_pool.pool()
    for w in pool._workers:  # ready, then dead: the first tensors sent find no one to answer them
        os.kill(w.proc.pid, signal.SIGKILL)
        w.proc.wait()
    assert tensor_pool.pool() is pool, "the pool does not know yet"
    prequant.convert(src, tmp_path / "workers", device="cpu", progress=False)
    assert pool.broken and pool.tensors == 0
    for shard in sorted(p.name for p in (tmp_path / "here").glob("*.safetensors")):
        assert (tmp_path / "here" / shard).read_bytes() == (tmp_path / "workers" / shard).read_bytes()
    manifests = [json.loads((tmp_path / d / "prequant.json").read_text()) for d in ("here", "workers")]
    assert manifests[0]["stats"] == manifests[1]["stats"]


def test_a_nan_tensor_fails_the_conversion_as_without_workers(pool, checkpoints, tmp_path):
    from conftest import read_checkpoint

    tensors = read_checkpoint(checkpoints("llama"))
    name = next(k for k in tensors if k.endswith("mlp.down_proj.weight"))
    tensors[name][3, 3] = float("nan")
    src = tmp_path / "src"
    src.mkdir()
    for f in checkpoints("llama").iterdir():
        if not f.name.endswith((".safetensors", ".json")) or f.name == "config.json":
            (src / f.name).write_bytes(f.read_bytes())
    save_file(tensors, str(src / "model.safetensors"))
    with pytest.raises(prequant.PrequantError, match=f"tensor '{name}' contains NaN or Inf"):
        prequant.convert(src, tmp_path / "out", device="cpu", progress=False)
    assert not (tmp_path / "out").exists() or not (tmp_path / "out" / "prequant.json").exists()
    assert not pool.busy()


def test_workers_the_cli_started_early_are_adopted_by_the_pool(monkeypatch, tmp_path):
    """`start_early` (the CLI, before torch) starts workers for a large enough local checkpoint on the CPU only;
    the pool then takes those processes rather than starting others."""
    tensor_pool.close()
    monkeypatch.setenv(tensor_pool.ENV, "2")
    monkeypatch.setattr(tensor_pool, "COUNT", None)
    tensor_spawn.start_early(tensor_spawn.MIN_BYTES - 1, "cpu")
    assert tensor_spawn._early == [], "a small checkpoint is not worth workers"
    tensor_spawn.start_early(tensor_spawn.MIN_BYTES, "cuda")
    assert tensor_spawn._early == [], "only for the CPU"
    monkeypatch.setattr(tensor_spawn, "GPU_DEVICES", (__file__,))  # a machine with a GPU
    tensor_spawn.start_early(tensor_spawn.MIN_BYTES, "auto")
    assert tensor_spawn._early == [], "auto on a machine with a GPU quantizes there"
    monkeypatch.setattr(tensor_spawn, "GPU_DEVICES", (str(tmp_path / "no-such-device"),))
    assert tensor_spawn._on_the_cpu("auto") and tensor_spawn._on_the_cpu("cpu") and not tensor_spawn._on_the_cpu("cuda:1")
    tensor_spawn.start_early(tensor_spawn.MIN_BYTES, "cpu")
    early = [proc.pid for proc, _ in tensor_spawn._early]
    assert len(early) == 2
    try:
        started = tensor_pool.pool()
        assert [w.proc.pid for w in started._workers] == early and tensor_spawn._early == []
        assert started.wait_ready()
    finally:
        tensor_pool.close()


def test_a_second_conversion_at_once_quantizes_in_its_own_process(pool, checkpoints, tmp_path):
    """One conversion at a time uses the workers: while another thread's holds them, a conversion quantizes in its
    own process (to the same bytes), and close() leaves the pool to the conversion using it."""
    src = checkpoints("llama")
    _without_workers(src, tmp_path / "here")
    pool = tensor_pool.pool()
    assert pool.owner.acquire(blocking=False)  # as a conversion on another thread holds it
    try:
        prequant.convert(src, tmp_path / "second", device="cpu", progress=False)
        assert pool.tensors == 0 and not pool.broken, "not used, and not closed under its user"
    finally:
        pool.owner.release()
    for shard in sorted(p.name for p in (tmp_path / "here").glob("*.safetensors")):
        assert (tmp_path / "here" / shard).read_bytes() == (tmp_path / "second" / shard).read_bytes()
    tensor_pool.close()
    assert pool.broken and tensor_pool._pool is None


def test_the_workers_go_on_while_the_writer_is_held_up(pool, tmp_path):
    """While the writer takes nothing (a shard's writes held up by the disk), the quantizing stage keeps giving the
    workers tensors until `most` finished ones wait for the writer; then every item still comes out, in plan order,
    with the entries this process computes."""
    import threading

    from prequant.bnb.layout import Decision
    from prequant.conversion.plan import Step
    from prequant.conversion.quantizing import quantize_all
    from prequant.conversion.stages import END, IN_FLIGHT, Stage

    most = pool.size * tensor_pool.JOBS_PER_WORKER + IN_FLIGHT
    n = IN_FLIGHT + most + 4
    g = torch.Generator().manual_seed(7)
    tensors = {f"w{i:02d}": torch.randn(64, 128, generator=g).to(torch.bfloat16) for i in range(n)}
    path, reader, views = _mapped(tmp_path, tensors)
    refs = {ref.name: ref for ref in read_header(path)[0]}

    class Counted(Stage):
        gets = 0

        def get(self):
            item = super().get()
            Counted.gets += 1
            return item

    failed = threading.Event()
    loaded, quantized = Counted(failed, "loaded", size=n + 1), Stage(failed, "quantized")
    for name in sorted(tensors):
        step = Step(refs[name], Decision(True, "a linear weight"), (), "model.safetensors")
        loaded.put((step, (views[name], None), None))
    loaded.put(END)
    quantizer = Quantizer(Settings(), torch.device("cpu"))
    stage = threading.Thread(target=quantize_all, args=(loaded, quantized, quantizer, None, None, 10**9))
    out: list[tuple] = []
    with reader:
        stage.start()
        try:
            # The writer holds: IN_FLIGHT items fill its queue, most + 1 wait here, one more waits to be put.
            taken = IN_FLIGHT + most + 1
            for _ in range(200):
                if Counted.gets >= taken:
                    break
                stage.join(0.05)
            assert Counted.gets >= taken, f"the stage stopped taking tensors at {Counted.gets} while the writer held"
            while (item := quantized.get()) is not END:
                out.append(item)
        finally:
            if len(out) < n:  # stop the stage where it waits
                failed.set()
            stage.join(10)
    assert [step.source.name for step, *_ in out] == sorted(tensors)
    assert pool.tensors == n, "the workers quantized every one"
    for step, entries, copied, found in out:
        name = step.source.name
        want = {entry_key(name, k): v for k, v in quantizer(tensors[name], name).items()}
        assert copied is None and found is None and list(entries) == list(want)
        for key, tensor in want.items():
            assert torch.equal(entries[key].view(torch.uint8), tensor.view(torch.uint8)), key
    assert pool.held == 0 and not pool.busy()
