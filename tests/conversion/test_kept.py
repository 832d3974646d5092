"""NaN and Inf in the tensors kept unquantized: NaN refused (see test_bad_inputs) unless --allow-nan, which copies
it as it is and records it; Inf recorded and reported, not refused; the records survive a kill and --resume."""

from __future__ import annotations

import json
import os
import shutil
import struct
import threading
from pathlib import Path

import pytest
import torch
from conftest import read_checkpoint, run_cli

import prequant
from prequant.bnb.quantize import Quantizer
from prequant.checkpoint.reader import scan_files
from prequant.conversion import kept
from prequant.conversion.kept import non_finite

NORM = "model.norm.weight"
EMBED = "model.embed_tokens.weight"
BF16_NAN, BF16_INF, BF16_NEG_INF = b"\xc0\x7f", b"\x80\x7f", b"\x80\xff"
ARGS = ("--device", "cpu", "--max-shard-size", "60KB")


def _poke(path: Path, tensor: str, value: bytes, element: int) -> None:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    begin = 8 + n + json.loads(raw[8 : 8 + n])[tensor]["data_offsets"][0] + element * len(value)
    with open(path, "r+b") as f:
        f.seek(begin)
        f.write(value)


@pytest.fixture
def source(checkpoints, tmp_path) -> Path:
    """The tiny Llama with 2 NaN in the final norm and 3 Inf in the embedding (a -inf among them)."""
    src = Path(shutil.copytree(checkpoints("llama"), tmp_path / "src"))
    shard = src / "model.safetensors"
    for element in (3, 9):
        _poke(shard, NORM, BF16_NAN, element)
    for element, value in ((0, BF16_INF), (100, BF16_NEG_INF), (5000, BF16_INF)):
        _poke(shard, EMBED, value, element)
    return src


def test_allow_nan_copies_it_as_it_is_and_records_it(source, tmp_path):
    out = tmp_path / "out"
    proc = run_cli("convert", str(source), str(out), *ARGS, "--allow-nan", "--json")
    assert proc.returncode == 0, proc.stderr
    theirs, ours = read_checkpoint(source), read_checkpoint(out)
    assert torch.equal(ours[NORM].view(torch.uint8), theirs[NORM].view(torch.uint8))  # NaN bit patterns kept
    manifest = json.loads((out / "prequant.json").read_text())
    assert manifest["options"]["allow_nan"] is True
    assert manifest["non_finite"] == {EMBED: {"nan": 0, "inf": 3}, NORM: {"nan": 2, "inf": 0}}
    assert json.loads(proc.stdout)["non_finite"] == manifest["non_finite"]
    assert run_cli("verify", str(out), "--source", str(source)).returncode == 0


def test_inf_in_a_kept_tensor_is_recorded_and_reported(checkpoints, tmp_path):
    src = Path(shutil.copytree(checkpoints("llama"), tmp_path / "src"))
    _poke(src / "model.safetensors", EMBED, BF16_NEG_INF, 7)  # an attention-mask-like -inf
    out = tmp_path / "out"
    proc = run_cli("convert", str(src), str(out), *ARGS)
    assert proc.returncode == 0, proc.stderr
    assert f"non-finite values kept as they are: {EMBED} (1 Inf)" in proc.stdout
    manifest = json.loads((out / "prequant.json").read_text())
    assert manifest["non_finite"] == {EMBED: {"nan": 0, "inf": 1}} and manifest["options"]["allow_nan"] is False


def test_the_record_survives_a_kill_and_resume(source, tmp_path):
    """The embedding is the first tensor written: killed later, the resumed run does not see it again."""
    clean = tmp_path / "clean"
    run_cli("convert", str(source), str(clean), *ARGS, "--allow-nan", check=True)
    out = tmp_path / "out"
    killed = run_cli("convert", str(source), str(out), *ARGS, "--allow-nan",
                     env={"PREQUANT_FAILPOINT": "shard-journaled:1"})
    assert killed.returncode == -9
    run_cli("convert", str(source), str(out), *ARGS, "--allow-nan", "--resume", check=True)
    ours, expected = (json.loads((d / "prequant.json").read_text()) for d in (out, clean))
    assert ours["non_finite"] == expected["non_finite"] == {EMBED: {"nan": 0, "inf": 3}, NORM: {"nan": 2, "inf": 0}}
    assert ours["files"] == expected["files"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_non_finite_counts(dtype):
    t = torch.zeros(3 * (1 << 24) + 5, dtype=dtype)  # several counting chunks
    assert non_finite(t) == (0, 0)
    t[[0, 1 << 24, -1]] = float("nan")
    t[[7, -2]] = float("inf")
    t[9] = -float("inf")
    assert non_finite(t) == (3, 3)
    assert non_finite(torch.tensor([1, 2], dtype=torch.int64)) == (0, 0)


def test_each_kept_tensor_is_asked_for_in_full_before_its_check(checkpoints, tmp_path, monkeypatch):
    """The check's thread asks the kernel for a kept tensor's whole byte range (posix_fadvise WILLNEED) before it
    checks the values, so the check does not read the tensor page fault by page fault behind the disk's queue."""
    src = checkpoints("llama")
    events: list[tuple] = []  # ("advice", file offset, length) from the check's thread, ("check", name)
    fadvise, check = os.posix_fadvise, kept.KeptCheck.__call__

    def advise(fd: int, offset: int, length: int, how: int) -> None:
        if how == os.POSIX_FADV_WILLNEED and threading.current_thread().name.startswith("prequant-check"):
            events.append(("advice", offset, length))
        fadvise(fd, offset, length, how)

    def checked(self, name: str, tensor):
        events.append(("check", name))
        return check(self, name, tensor)

    monkeypatch.setattr(os, "posix_fadvise", advise)
    monkeypatch.setattr(kept.KeptCheck, "__call__", checked)
    prequant.convert(src, tmp_path / "out", device="cpu", progress=False)

    refs = {r.name: r for r in scan_files(sorted(src.glob("*.safetensors")))}
    names = [e[1] for e in events if e[0] == "check"]
    assert EMBED in names and NORM in names
    for name in names:
        at = events.index(("check", name))
        before = [e for e in events[:at] if e[0] == "advice"]
        start, end = refs[name].offset, refs[name].offset + refs[name].nbytes
        covered = start
        for offset, length in sorted(b[1:] for b in before):  # the pieces of this tensor's range, in order
            if offset <= covered < offset + length:
                covered = offset + length
        assert covered >= end, (name, start, end, covered)


def test_the_reader_goes_on_while_a_kept_tensor_is_checked(checkpoints, tmp_path, monkeypatch):
    """A kept tensor's check (a cold 1 GB embedding takes seconds) does not hold up the tensors after it: here
    the embedding's check waits until a layer after it in the file has been quantized, which never happens if
    the reader itself checks. The writer still waits for the check, so the output is the usual one."""
    src = checkpoints("llama")
    quantized = threading.Event()
    check, call = kept.KeptCheck.__call__, Quantizer.__call__

    def quantize(self, x, name):
        if name.startswith("model.layers."):
            quantized.set()
        return call(self, x, name)

    during_check: list[bool] = []  # asserted afterwards: a failure's traceback must not hold a mapped view

    def checked(self, name: str, tensor):
        if name == EMBED:
            during_check.append(quantized.wait(60))
        return check(self, name, tensor)

    monkeypatch.setattr(Quantizer, "__call__", quantize)
    monkeypatch.setattr(kept.KeptCheck, "__call__", checked)
    prequant.convert(src, tmp_path / "out", device="cpu", progress=False)
    assert during_check == [True], "no layer was quantized while the embedding was being checked"
    monkeypatch.undo()
    prequant.convert(src, tmp_path / "plain", device="cpu", progress=False)
    shards = sorted(p.name for p in (tmp_path / "plain").glob("*.safetensors"))
    assert shards and shards == sorted(p.name for p in (tmp_path / "out").glob("*.safetensors"))
    for name in shards:
        assert (tmp_path / "out" / name).read_bytes() == (tmp_path / "plain" / name).read_bytes(), name
