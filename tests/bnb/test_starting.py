"""bnb.starting: a CUDA conversion's pipeline runs while CUDA starts, the CPU quantizing meanwhile, same bytes.

The hand-over is driven through the real pipeline (`conversion.pipeline.run`) on a real checkpoint; the quantizer
that "starts" is held back until the writer has written the first quantized tensor, so that tensors were read
both before and after it was ready, whatever the machine's speed. Without a GPU the one that starts is a CPU
quantizer (the hand-over logic is the same); on a GPU it is bitsandbytes' CUDA quantizer, and the bytes are
transformers' own.
"""

from __future__ import annotations

import logging
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

from conftest import build_checkpoint, gpu_only, read_checkpoint, transformers_reference


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return build_checkpoint("llama", tmp_path_factory.mktemp("starting-src"))


def _convert_while_starting(src: Path, staging: Path, device: torch.device) -> tuple[Starting, int]:
    """Run the pipeline on a Starting whose quantizer for `device` becomes ready only once the first quantized
    tensor is written (the writer waits for it there); return it and the number of tensors quantized."""
    plan = prequant.convert(src, staging.parent / "never-written", dry_run=True, progress=False)
    gate = threading.Event()

    def start() -> Quantizer:
        gate.wait()
        return Quantizer(plan.settings, device)

    quantizers = Starting(plan.settings, start)

    def on_step(step) -> None:
        if step.quantize and not gate.is_set():
            gate.set()
            quantizers.wait()  # nothing more is written, so little more is read, until it is ready

    staging.mkdir()
    source = resolve(str(src), stream=True)
    with reader(source, [s.source for s in plan.steps]) as data:
        pipeline.run(plan, data, quantizers, staging, on_step=on_step)
    return quantizers, sum(s.quantize for s in plan.steps)


def _same_files(a: Path, b: Path) -> None:
    names = sorted(p.name for p in a.glob("*.safetensors"))
    assert names and names == sorted(p.name for p in b.glob("*.safetensors"))
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_tensors_read_before_and_after_the_hand_over_give_a_plain_conversions_bytes(llama, tmp_path):
    quantizers, quantized = _convert_while_starting(llama, tmp_path / "staging", torch.device("cpu"))
    assert 1 <= quantizers.early < quantized  # both quantizers took tensors
    prequant.convert(llama, tmp_path / "plain", device="cpu", progress=False)
    _same_files(tmp_path / "staging", tmp_path / "plain")


@pytest.mark.parametrize(("env", "cold", "meanwhile"), [
    (None, False, True), (None, True, False), ("auto", False, True), ("auto", True, False), ("0", False, False),
    ("1", True, True), (" AUTO ", True, False),
])  # fmt: skip
def test_the_environment_says_whether_cuda_s_start_is_waited_for(monkeypatch, env, cold, meanwhile):
    """PREQUANT_CPU_WHILE_CUDA_STARTS: 0 waits for CUDA; 1 quantizes on the CPU meanwhile even after a cold start;
    unset or auto, meanwhile unless the libraries were cold."""
    if env is None:
        monkeypatch.delenv(starting.ENV, raising=False)
    else:
        monkeypatch.setenv(starting.ENV, env)
    assert starting.meanwhile(cold) is meanwhile


def test_a_value_it_does_not_know_is_said_and_taken_as_auto(monkeypatch, caplog):
    monkeypatch.setenv(starting.ENV, "workers")  # a value an earlier build knew
    with caplog.at_level(logging.WARNING, logger="prequant.bnb.starting"):
        assert starting.meanwhile(cold=True) is False and starting.meanwhile(cold=False) is True
    assert f"{starting.ENV}='workers' is none of 0, 1 or auto" in caplog.text
    monkeypatch.setenv(starting.ENV, " Yes ")  # said as it was given, not as it was compared
    with caplog.at_level(logging.WARNING, logger="prequant.bnb.starting"):
        assert starting.meanwhile(cold=True) is False
    assert f"{starting.ENV}=' Yes ' is none of 0, 1 or auto" in caplog.text


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
        quantizers.wait()  # and so does anything that asks for the device afterwards (the summary, the manifest)


def test_off_cuda_there_is_nothing_to_start(monkeypatch):
    settings = prequant.ConvertOptions().settings
    assert isinstance(starting.quantizer(settings, "cpu"), Quantizer)
    asked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: asked.append(True) or False)
    q = starting.quantizer(settings, "auto", 2**40)
    assert isinstance(q, Quantizer) and q.device == torch.device("cpu") and asked == [True]


def _transformers_bytes(ours: Path, ref: Path) -> None:
    """Every tensor of the shards in `ours` is transformers' (same keys, dtypes, bytes)."""
    mine, theirs = read_checkpoint(ours), read_checkpoint(ref)
    assert sorted(mine) == sorted(theirs)
    for k in mine:
        assert mine[k].dtype == theirs[k].dtype and torch.equal(mine[k].view(torch.uint8), theirs[k].view(torch.uint8)), k


@gpu_only
def test_bitsandbytes_takes_over_from_the_cpu_kernel_with_transformers_bytes(llama, tmp_path):
    ref = transformers_reference(llama, tmp_path / "ref", device="cuda")
    quantizers, quantized = _convert_while_starting(llama, tmp_path / "staging", torch.device("cuda", 0))
    assert 1 <= quantizers.early < quantized
    assert quantizers.device == torch.device("cuda", 0)
    _transformers_bytes(tmp_path / "staging", ref)


@gpu_only
def test_a_fresh_process_on_cuda_starts_cuda_on_a_thread_and_writes_transformers_bytes(llama, tmp_path):
    """The CLI in a new process: CUDA is not started yet, so the conversion takes the Starting path (how many tensors
    the CPU took meanwhile depends on timing: the test above holds that)."""
    import json

    from conftest import run_cli

    ref = transformers_reference(llama, tmp_path / "ref", device="cuda")
    trace = tmp_path / "trace.json"
    run_cli("convert", str(llama), str(tmp_path / "out"), "--device", "cuda", env={"PREQUANT_TRACE": str(trace)}, check=True)
    events = dict(json.loads(trace.read_text())["events"])
    assert "cuda-ready" in events  # marked by Starting's thread only
    _transformers_bytes(tmp_path / "out", ref)
