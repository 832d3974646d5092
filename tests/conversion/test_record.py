"""prequant.json: file hashes, source identity, versions, options and per-tensor statistics; JSON progress."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import run_cli, run_main

import prequant
from prequant.checkpoint import manifest
from prequant.conversion import output
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
