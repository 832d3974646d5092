"""convert() of an FP8 source equals, byte for byte, convert() of the 16-bit checkpoint its reference dequantization
writes (DeepSeek's weight_dequant for block-scaled FP8, compressed-tensors' decompression for its per-tensor and
per-channel FP8): `tests/fp8_checkpoints.py` builds both from the same stored tensors."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from fp8_checkpoints import fp8_pair, outputs

import prequant
from prequant.checkpoint.reader import scan_files
from prequant.errors import PrequantError

CASES = [("block", torch.float32), ("block", torch.bfloat16), ("channel", torch.bfloat16), ("tensor", torch.float32)]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """(FP8 source, its 16-bit reference, and each one converted on the CPU) per case, built once."""
    made: dict[tuple, tuple[Path, Path, Path, Path]] = {}

    def get(fmt: str, scale_dtype: torch.dtype) -> tuple[Path, Path, Path, Path]:
        if (fmt, scale_dtype) not in made:
            root = tmp_path_factory.mktemp(f"{fmt}-{str(scale_dtype).removeprefix('torch.')}")
            src, ref = fp8_pair(root, fmt, scale_dtype)
            prequant.convert(src, root / "out-fp8", device="cpu", progress=False, max_shard_size="150KB")
            prequant.convert(ref, root / "out-ref", device="cpu", progress=False, max_shard_size="150KB")
            made[fmt, scale_dtype] = (src, ref, root / "out-fp8", root / "out-ref")
        return made[fmt, scale_dtype]

    return get


@pytest.mark.parametrize("fmt, scale_dtype", CASES)
def test_converting_fp8_is_converting_the_reference_dequantization(pairs, fmt, scale_dtype):
    _, _, ours, ref = pairs(fmt, scale_dtype)
    got, wanted = outputs(ours), outputs(ref)
    assert len([n for n in got if n.endswith(".safetensors")]) > 1  # sharded, index included
    assert got.keys() == wanted.keys()
    for name in wanted:
        assert got[name] == wanted[name], name


@pytest.mark.parametrize("fmt, scale_dtype", CASES)
def test_no_scale_or_activation_parameter_reaches_the_output(pairs, fmt, scale_dtype):
    _, _, ours, _ = pairs(fmt, scale_dtype)
    keys = [t.name for t in scan_files(sorted(ours.glob("*.safetensors")))]
    assert keys and not [k for k in keys if k.rpartition(".")[2] in ("weight_scale_inv", "weight_scale",
                                                                     "input_scale", "k_scale")]
    assert any(k.endswith("q_proj.weight.absmax") for k in keys)
    index = json.loads((ours / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(keys)


@pytest.mark.parametrize("fmt, scale_dtype", CASES[:1] + CASES[2:3])
def test_config_carries_bitsandbytes_quantization_config_and_the_card_says_fp8(pairs, fmt, scale_dtype):
    src, _, ours, _ = pairs(fmt, scale_dtype)
    config = json.loads((ours / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "bitsandbytes"
    source = json.loads((src / "config.json").read_text())
    assert {k: v for k, v in config.items() if k != "quantization_config"} == {
        k: v for k, v in source.items() if k != "quantization_config"}
    card = (ours / "README.md").read_text()
    assert ("block-scaled FP8 (128x128 blocks)" if fmt == "block" else "compressed-tensors FP8") in card
    assert "FP8" not in (pairs(fmt, scale_dtype)[3] / "README.md").read_text()


def test_a_kept_fp8_weight_is_written_dequantized(tmp_path):
    src, ref = fp8_pair(tmp_path, "block", torch.bfloat16)
    skip = ["model.layers.0.mlp.down_proj"]
    prequant.convert(src, tmp_path / "a", device="cpu", progress=False, skip=skip)
    prequant.convert(ref, tmp_path / "b", device="cpu", progress=False, skip=skip)
    assert outputs(tmp_path / "a") == outputs(tmp_path / "b")
    kept = {t.name: t for t in scan_files([tmp_path / "a" / "model.safetensors"])}
    assert kept["model.layers.0.mlp.down_proj.weight"].dtype == "BF16"


def test_a_dry_run_plans_fp8_weights_as_16_bit(tmp_path):
    src, ref = fp8_pair(tmp_path, "tensor", torch.float32)
    plan = prequant.convert(src, tmp_path / "unused", dry_run=True).to_dict()
    wanted = prequant.convert(ref, tmp_path / "unused", dry_run=True).to_dict()
    assert plan == wanted


def test_e5m2_weights_are_refused_naming_the_tensor(tmp_path):
    from fp8_checkpoints import write_checkpoint

    w = torch.randn(160, 160).to(torch.float8_e5m2)
    src = write_checkpoint(tmp_path / "src", [{"model.embed_tokens.weight": torch.zeros(256, 160, dtype=torch.bfloat16),
                                               "model.layers.0.self_attn.q_proj.weight": w,
                                               "model.layers.0.self_attn.q_proj.weight_scale_inv": torch.ones(2, 2)}],
                           {"model_type": "llama", "dtype": "bfloat16",
                            "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}})
    with pytest.raises(PrequantError, match=r"'model\.layers\.0\.self_attn\.q_proj\.weight' is F8_E5M2"):
        prequant.convert(src, tmp_path / "out", device="cpu", progress=False)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").glob("*.safetensors"))


def test_a_hub_fp8_source_converts_as_the_local_one(hub_server, pairs, tmp_path):
    src, _, local_out, _ = pairs("block", torch.float32)
    hub_server.add_repo("org/tiny-fp8", {p.name: p for p in src.iterdir() if p.is_file()})
    prequant.convert("org/tiny-fp8", tmp_path / "hub", device="cpu", progress=False, max_shard_size="150KB",
                     delete_source_shards=True)
    assert outputs(tmp_path / "hub") == outputs(local_out)
    # Every shard is evicted once converted: its scales and input scales count as done with their weights.
    cache = Path(os.environ["HF_HOME"]) / "hub" / "models--org--tiny-fp8"
    assert cache.is_dir() and not list(cache.glob("snapshots/*/*.safetensors"))
    assert not [p for p in cache.glob("blobs/*") if p.stat().st_size > 10_000]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("fmt, scale_dtype", CASES)
def test_cuda_gives_the_cpu_bytes(pairs, fmt, scale_dtype, tmp_path):
    src, _, cpu_out, _ = pairs(fmt, scale_dtype)
    prequant.convert(src, tmp_path / "cuda", device="cuda", progress=False, max_shard_size="150KB")
    assert outputs(tmp_path / "cuda") == outputs(cpu_out)


def test_a_hub_fp8_shard_is_evicted_once_its_tensors_and_their_scales_are_done(hub_server, pairs):
    """With --delete-source-shards each shard leaves the disk after its last tensor: the scales and input scales the
    plan never names count as done with their weights, or the shards holding them would stay until the end."""
    from prequant.source.resolve import contents, reader, resolve

    src_dir = pairs("channel", torch.bfloat16)[0]
    hub_server.add_repo("org/tiny-fp8-ct", {p.name: p for p in src_dir.iterdir() if p.is_file()})
    src = resolve("org/tiny-fp8-ct", stream=True, delete=True)
    held = contents(src)
    cache = Path(os.environ["HF_HOME"]) / "hub" / "models--org--tiny-fp8-ct"
    with reader(src, held.tensors, delete=True, start=True) as data:
        for t in held.tensors:
            data.prepare(t.file)
            assert data.view(t).dtype == torch.bfloat16
            data.tensor_done(t)
        assert not [p.name for p in cache.glob("blobs/*") if p.stat().st_size > 10_000]  # before the reader closes


@pytest.mark.parametrize("fmt, scale_dtype", CASES[:1] + CASES[2:3])
def test_verify_against_the_fp8_source_compares_the_dequantized_weights(pairs, fmt, scale_dtype):
    from prequant.verify import verify

    src, _, ours, _ = pairs(fmt, scale_dtype)
    report = verify(ours, source=src, progress=False)
    assert report.ok, report.to_dict()
    compared = report.to_dict()["source"]
    assert compared["quantized"] == 14 and compared["kept"] == 7  # no scale counted, every weight compared


def test_progress_and_summary_count_an_fp8_source_as_the_bytes_read_from_disk(tmp_path, monkeypatch, capsys):
    """Progress and the summary count an FP8 weight as it is read (its float8 bytes, its scale, its module's
    activation parameters), not at its 16-bit size: the total, the bytes done at the end and the summary's input
    size are the source's tensor bytes on disk."""
    src, _ = fp8_pair(tmp_path, "channel", torch.bfloat16)
    monkeypatch.setenv("PREQUANT_PROGRESS", "json")
    monkeypatch.setenv("PREQUANT_PROGRESS_INTERVAL", "0")
    summary = prequant.convert(src, tmp_path / "out", device="cpu")
    records = [json.loads(line) for line in capsys.readouterr().err.splitlines() if line.startswith("{")]
    on_disk = sum(t.nbytes for t in scan_files(sorted(src.glob("*.safetensors"))))
    assert records[-1]["event"] == "done" and records[-1]["done_bytes"] == on_disk
    assert {r["total_bytes"] for r in records if r["task"] == "converting"} == {on_disk}
    assert summary.input_bytes == on_disk
