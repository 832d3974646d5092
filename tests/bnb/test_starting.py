"""bnb.starting: the quantizer is built on a thread while the caller goes on; the pipeline writes the kept tensors
that come first meanwhile, and its first tensor to quantize waits for it.

Driven through the real pipeline (`conversion.pipeline.run`) on a real checkpoint. Without a GPU the quantizer
that "starts" is a CPU quantizer held back by the test; on a GPU it is bitsandbytes' CUDA quantizer, started in a
fresh process by the CLI, and the bytes are transformers' own.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

import prequant
from prequant.bnb import starting
from prequant.bnb.quantize import Quantizer
from prequant.bnb.starting import Starting
from prequant.conversion import pipeline
from prequant.errors import PrequantError
from prequant.source.resolve import reader, resolve

from helpers import build_checkpoint, gpu_only, read_checkpoint, transformers_reference


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return build_checkpoint("llama", tmp_path_factory.mktemp("starting-src"))


def test_the_pipeline_writes_only_kept_tensors_before_its_quantizer_is_built_and_then_a_plain_conversions_bytes(
        llama, tmp_path):
    plan = prequant.convert(llama, tmp_path / "never-written", dry_run=True, progress=False)
    events: list[str] = []
    release = threading.Timer(0.5, lambda: None)

    def build() -> Quantizer:
        release.join()  # long enough for a pipeline that did not wait to write its first tensors
        events.append("built")
        return Quantizer(plan.settings, torch.device("cpu"))

    release.start()
    quantizer = Starting(plan.settings, build)
    staging = tmp_path / "staging"
    staging.mkdir()
    with reader(resolve(str(llama), stream=True), [s.source for s in plan.steps]) as data:
        pipeline.run(plan, data, quantizer, staging, on_step=lambda step: events.append(step.source.name))
    assert len(events) == len(plan.steps) + 1
    before = events[: events.index("built")]
    assert before, "the kept tensors that come first were not written while the quantizer started"
    needs = {s.source.name for s in plan.steps if s.quantize or s.decision.dtype}
    assert not needs & set(before), "a tensor that needs the quantizer was written before it was built"
    assert len(before) < len(plan.steps)
    prequant.convert(llama, tmp_path / "plain", device="cpu", progress=False)
    names = sorted(p.name for p in (tmp_path / "plain").glob("*.safetensors"))
    assert names and names == sorted(p.name for p in staging.glob("*.safetensors"))
    for name in names:
        assert (staging / name).read_bytes() == (tmp_path / "plain" / name).read_bytes(), name


def test_a_failed_start_fails_the_conversion_with_its_error(llama, tmp_path):
    def start() -> Quantizer:
        raise PrequantError("bitsandbytes is not importable (test); install it")

    plan = prequant.convert(llama, tmp_path / "never-written", dry_run=True, progress=False)
    quantizers = Starting(plan.settings, start)
    (tmp_path / "staging").mkdir()
    data = reader(resolve(str(llama), stream=True), [s.source for s in plan.steps])
    with data, pytest.raises(PrequantError, match="bitsandbytes is not importable"):
        pipeline.run(plan, data, quantizers, tmp_path / "staging")
    with pytest.raises(PrequantError, match="bitsandbytes is not importable"):
        quantizers.device  # and so does anything that asks for the device afterwards (the summary, the manifest)


def test_off_cuda_there_is_nothing_to_start(monkeypatch):
    settings = prequant.ConvertOptions().settings
    assert isinstance(starting.quantizer(settings, "cpu"), Quantizer)
    asked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: asked.append(True) or False)
    q = starting.quantizer(settings, "auto", 2**40)
    assert isinstance(q, Quantizer) and q.device == torch.device("cpu") and asked == [True]


@gpu_only
def test_a_fresh_process_on_cuda_starts_cuda_on_a_thread_and_writes_transformers_bytes(llama, tmp_path):
    """The CLI in a new process: CUDA is not started yet, so the quantizer is built on a thread."""
    import json

    from helpers import run_cli

    ref = transformers_reference(llama, tmp_path / "ref", device="cuda")
    trace = tmp_path / "trace.json"
    run_cli("convert", str(llama), str(tmp_path / "out"), "--device", "cuda", env={"PREQUANT_TRACE": str(trace)}, check=True)
    events = dict(json.loads(trace.read_text())["events"])
    assert "cuda-ready" in events  # marked when the quantizer's thread has built it
    mine, theirs = read_checkpoint(tmp_path / "out"), read_checkpoint(ref)
    assert sorted(mine) == sorted(theirs)
    for k in mine:
        assert mine[k].dtype == theirs[k].dtype and torch.equal(mine[k].view(torch.uint8), theirs[k].view(torch.uint8)), k


def test_work_after_the_start_waits_for_the_quantizer_and_runs_at_once_without_one():
    settings = prequant.ConvertOptions().settings
    built, called = threading.Event(), threading.Event()
    order: list[str] = []

    def build() -> Quantizer:
        built.wait(10)
        order.append("built")
        return Quantizer(settings, torch.device("cpu"))

    quantizer = Starting(settings, build)
    starting.after_start(quantizer, lambda: (order.append("called"), called.set()))
    assert not called.wait(0.3), "ran before the quantizer was built"
    built.set()
    assert called.wait(10)
    assert order == ["built", "called"]
    starting.after_start(quantizer, lambda: order.append("again"))  # built already: at once
    starting.after_start(Quantizer(settings, torch.device("cpu")), lambda: order.append("cpu"))
    assert order == ["built", "called", "again", "cpu"]
