"""prequant.json: file hashes, source identity, versions, options and per-tensor statistics; JSON progress; NaN and
Inf in the tensors kept unquantized."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import threading
from pathlib import Path

import pytest
import torch
from helpers import read_checkpoint, run_cli, run_main

import prequant
from prequant.bnb.quantize import Quantizer
from prequant.checkpoint import manifest
from prequant.checkpoint.reader import scan_files
from prequant.conversion import output, record
from prequant.conversion.record import non_finite
from prequant.errors import PrequantError


def _manifest(out: Path) -> dict:
    return json.loads((out / "prequant.json").read_text())


def test_every_output_file_is_listed_with_size_and_sha256(converted_llama):
    _, out = converted_llama
    files = _manifest(out)["files"]
    on_disk = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()} - {"prequant.json"}
    assert set(files) == on_disk
    assert {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "config.json", "README.md",
            "model.safetensors.index.json", "tokenizer_config.json", "LICENSE"} <= on_disk
    for name, entry in files.items():
        data = (out / name).read_bytes()
        assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}, name


def test_source_versions_and_options_are_recorded(converted_llama):
    src, out = converted_llama
    m = _manifest(out)
    assert m["format"] == "prequant-manifest"
    assert m["source"]["path"] == str(src) and m["source"]["weight_files"] == {"model.safetensors": (src / "model.safetensors").stat().st_size}
    assert m["source"]["sha256"]["config.json"] == hashlib.sha256((src / "config.json").read_bytes()).hexdigest()
    assert m["versions"]["prequant"] == prequant.__version__ and m["versions"]["torch"] == torch.__version__
    assert {"bitsandbytes", "transformers", "safetensors", "huggingface_hub"} <= set(m["versions"])
    assert {
        "quant_type": "nf4", "double_quant": True, "blocksize": 64, "quant_storage": "bfloat16", "skip": [],
        "max_shard_size": 100_000, "stats": True,
    }.items() <= m["options"].items()
    assert m["device"] == "cpu"


def test_stats_cover_every_quantized_tensor_with_the_nf4_error(converted_llama):
    _, out = converted_llama
    m = _manifest(out)
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    quantized = {k.removesuffix(".absmax") for k in index if k.endswith(".weight.absmax")}
    assert set(m["tensors"]) == quantized and m["stats"]["complete"]
    for name, st in m["tensors"].items():
        # NF4, block 64, on Gaussian init: ~0.092 relative error; an element never off by more than
        # half the widest code gap (~0.14 of its block's scale).
        assert 0.07 < st["rel_error"] < 0.12, name
        assert 0 < st["absmax_min"] <= st["absmax_max"] and st["max_abs_error"] < 0.2 * st["absmax_max"], name
    assert m["stats"]["summary"]["tensors"] == len(quantized)


def test_no_stats_still_hashes_everything(checkpoints, tmp_path):
    out = tmp_path / "out"
    summary = prequant.convert(checkpoints("llama"), out, device="cpu", progress=False, stats=False)
    m = _manifest(out)
    assert m["stats"]["enabled"] is False and m["tensors"] == {} and summary.stats is None
    assert "model.safetensors" in m["files"]


def test_transposed_conv1d_weights_are_measured_in_their_quantized_layout(converted_gpt2):
    _, out = converted_gpt2
    tensors = _manifest(out)["tensors"]
    assert "transformer.h.0.attn.c_attn.weight" in tensors
    assert all(0.07 < st["rel_error"] < 0.12 for st in tensors.values())


def test_transposed_tensors_are_recorded(converted_gpt2, converted_llama):
    """Every Conv1D weight, the square attn.c_proj included (its shape cannot tell); nothing for nn.Linear."""
    m = _manifest(converted_gpt2[1])
    assert m["format_version"] == 2
    assert sorted(m["transposed"]) == [f"transformer.h.{i}.{name}.weight" for i in range(2)
                                       for name in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")]
    assert set(m["transposed"]) == set(m["tensors"])
    assert _manifest(converted_llama[1])["transposed"] == []


def test_older_manifest_without_the_record_loads_and_a_malformed_one_fails(converted_llama, tmp_path):
    out = Path(shutil.copytree(converted_llama[1], tmp_path / "out"))
    m = _manifest(out)
    del m["transposed"]
    (out / "prequant.json").write_text(json.dumps(m | {"format_version": 1}))
    assert "transposed" not in manifest.load(out)
    (out / "prequant.json").write_text(json.dumps(m | {"transposed": "model.layers.0.mlp.up_proj.weight"}))
    with pytest.raises(PrequantError, match='prequant.json: its "transposed" list is malformed'):
        manifest.load(out)


def test_manifest_is_published_before_config(checkpoints, tmp_path, monkeypatch):
    out, moved, real = tmp_path / "out", [], output.os.replace
    # Only moves into OUTPUT_DIR are the publish (the writers' own renames stay inside staging).
    monkeypatch.setattr(output.os, "replace", lambda a, b: (Path(b).parent == out and moved.append(Path(b).name), real(a, b)))
    prequant.convert(checkpoints("llama"), out, device="cpu", progress=False)
    assert moved[-1] == "config.json" and moved.index("prequant.json") < moved.index("config.json")


def test_convert_json_and_progress_json_lines(checkpoints, tmp_path):
    """CI mode: the summary is JSON on stdout, progress is JSON lines on stderr."""
    proc = run_cli(
        "convert", str(checkpoints("llama")), str(tmp_path / "out"), "--device", "cpu", "--json",
        env={"PREQUANT_PROGRESS": "json", "PREQUANT_PROGRESS_INTERVAL": "0"},
    )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["stats"]["tensors"] == summary["tensors_quantized"] == 14
    records = [json.loads(line) for line in proc.stderr.splitlines()]
    assert records and records[-1]["event"] == "done" and records[-1]["fraction"] == 1.0
    assert all(r["task"] == "converting" and r["total_bytes"] == summary["input_bytes"] for r in records)


def test_no_stats_flag(checkpoints, tmp_path):
    code, stdout, stderr = run_main("convert", str(checkpoints("llama")), str(tmp_path / "out"), "--device", "cpu",
                                    "--no-stats", "--json")
    assert code == 0, stderr
    assert json.loads(stdout)["stats"] is None
    assert _manifest(tmp_path / "out")["stats"]["enabled"] is False


# NaN and Inf in the tensors kept unquantized: NaN refused (see test_bad_inputs) unless --allow-nan, which copies
# it as it is and records it; Inf recorded and reported, not refused; the records survive a kill and --resume.

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
    fadvise, check = os.posix_fadvise, record.KeptCheck.__call__

    def advise(fd: int, offset: int, length: int, how: int) -> None:
        if how == os.POSIX_FADV_WILLNEED and threading.current_thread().name.startswith("prequant-check"):
            events.append(("advice", offset, length))
        fadvise(fd, offset, length, how)

    def checked(self, name: str, tensor):
        events.append(("check", name))
        return check(self, name, tensor)

    monkeypatch.setattr(os, "posix_fadvise", advise)
    monkeypatch.setattr(record.KeptCheck, "__call__", checked)
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
    check, call = record.KeptCheck.__call__, Quantizer.__call__

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
    monkeypatch.setattr(record.KeptCheck, "__call__", checked)
    prequant.convert(src, tmp_path / "out", device="cpu", progress=False)
    assert during_check == [True], "no layer was quantized while the embedding was being checked"
    monkeypatch.undo()
    prequant.convert(src, tmp_path / "plain", device="cpu", progress=False)
    shards = sorted(p.name for p in (tmp_path / "plain").glob("*.safetensors"))
    assert shards and shards == sorted(p.name for p in (tmp_path / "out").glob("*.safetensors"))
    for name in shards:
        assert (tmp_path / "out" / name).read_bytes() == (tmp_path / "plain" / name).read_bytes(), name


def test_a_link_out_of_the_source_is_not_copied_and_no_copy_is_more_readable_than_its_original(checkpoints,
                                                                                                tmp_path, caplog):
    src = tmp_path / "src"
    shutil.copytree(checkpoints("llama"), src)
    secret = tmp_path / "elsewhere" / "token"
    secret.parent.mkdir()
    secret.write_text("hf_secret\n")
    secret.chmod(0o600)
    (src / "token.txt").symlink_to(secret)  # a secret linked into the model's folder
    (src / "NOTICE").symlink_to("LICENSE")  # a link inside the source: followed
    (src / "private.json").write_text("{}")
    (src / "private.json").chmod(0o600)
    prequant.convert(src, tmp_path / "out", device="cpu", progress=False)
    out = tmp_path / "out"
    assert not (out / "token.txt").exists()
    assert "token.txt is a link to" in caplog.text and "not copied" in caplog.text
    assert (out / "NOTICE").read_text() == (src / "LICENSE").read_text()
    assert (out / "private.json").stat().st_mode & 0o777 == 0o600
    assert "token.txt" not in _manifest(out)["files"]


def test_a_hub_source_s_side_files_come_through_the_cache_s_links(hub_server, checkpoints, tmp_path):
    src = checkpoints("llama")
    hub_server.add_repo("org/tiny", {p.name: p for p in src.iterdir() if p.is_file()})
    prequant.convert("org/tiny", tmp_path / "out", device="cpu", progress=False)
    for name in ("tokenizer_config.json", "LICENSE", "generation_config.json"):
        assert (tmp_path / "out" / name).read_bytes() == (src / name).read_bytes()


def test_an_adapter_s_files_are_never_side_files(tmp_path):
    (tmp_path / "lora").mkdir()
    for name in ("adapter_config.json", "tokenizer_config.json", "lora/adapter_config.json", "lora/README.md"):
        (tmp_path / name).write_text("{}")
    assert record.side_files(tmp_path) == [Path("tokenizer_config.json")]


def test_a_cache_snapshot_s_links_into_its_blobs_are_followed_and_no_others(tmp_path):
    repo = tmp_path / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (repo / "blobs" / "0f1e").write_text("{}")
    (snapshot / "tokenizer_config.json").symlink_to("../../blobs/0f1e")
    (tmp_path / "key").write_text("secret")
    (snapshot / "key.txt").symlink_to(tmp_path / "key")
    assert record.side_files(snapshot) == [Path("tokenizer_config.json")]


def test_a_folder_named_snapshots_outside_a_cache_lets_no_link_into_its_sibling_blobs_through(tmp_path):
    """Only a snapshot of a cache repo (models--org--name/snapshots/<commit>) may link into that repo's blobs/."""
    (tmp_path / "blobs").mkdir()
    (tmp_path / "blobs" / "key").write_text("secret")
    source = tmp_path / "snapshots" / "model"
    source.mkdir(parents=True)
    (source / "tokenizer_config.json").write_text("{}")
    (source / "key.txt").symlink_to("../../blobs/key")
    assert record.side_files(source) == [Path("tokenizer_config.json")]
