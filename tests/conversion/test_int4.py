"""convert() of an INT4 pack-quantized compressed-tensors source (Kimi-K2-Thinking's format) equals, byte for byte,
convert() of the 16-bit checkpoint compressed-tensors' own decompression writes from the same stored tensors
(`tests/quantized_checkpoints.py` builds both with its compressor), with and without --quantize-experts; and every
layout prequant cannot read is refused in one line naming the tensor, writing nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from fp8_checkpoints import outputs, write_safetensors
from quantized_checkpoints import int4_pair, kimi_qc

import prequant
from prequant.checkpoint.reader import scan_files
from prequant.errors import PrequantError

KIMI = ("group", True)
SCHEMES = [KIMI, ("group", False), ("channel", True), ("channel", False), ("tensor", True)]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """(INT4 source, its 16-bit reference) per scheme, built once."""
    made: dict[tuple[str, bool], tuple[Path, Path]] = {}

    def get(strategy: str, symmetric: bool) -> tuple[Path, Path]:
        if (strategy, symmetric) not in made:
            root = tmp_path_factory.mktemp(f"int4-{strategy}-{'sym' if symmetric else 'asym'}")
            made[strategy, symmetric] = int4_pair(root, kimi_qc(strategy, symmetric))
        return made[strategy, symmetric]

    return get


def _converted(src: Path, ref: Path, out: Path, **options) -> tuple[dict[str, bytes], dict[str, bytes]]:
    prequant.convert(src, out / "int4", device="cpu", progress=False, max_shard_size="40KB", **options)
    prequant.convert(ref, out / "ref", device="cpu", progress=False, max_shard_size="40KB", **options)
    return outputs(out / "int4"), outputs(out / "ref")


@pytest.mark.parametrize("strategy, symmetric", SCHEMES)
@pytest.mark.parametrize("experts", [False, True])
def test_converting_int4_is_converting_compressed_tensors_decompression(pairs, tmp_path, monkeypatch, strategy,
                                                                          symmetric, experts):
    """Each weight dequantized in several pieces of rows, on two CPU threads (as the pipeline runs a large one)."""
    from prequant.bnb.kernels import _parallel
    from prequant.checkpoint import lookup

    monkeypatch.setattr(lookup, "CPU_PIECE", 100)  # 3 rows of 32 columns a piece: edges inside the weights
    monkeypatch.setattr(_parallel, "THREADS", 2)
    run, pieces = _parallel.run, []

    def on_threads(count, work):
        pieces.append(count)
        run(count, work)

    monkeypatch.setattr(_parallel, "run", on_threads)
    got, wanted = _converted(*pairs(strategy, symmetric), tmp_path, quantize_experts=experts)
    assert max(pieces) > 1
    assert len([n for n in got if n.endswith(".safetensors")]) > 1  # sharded, index included
    assert got.keys() == wanted.keys()
    for name in wanted:
        assert got[name] == wanted[name], name
    keys = {t.name for f in sorted((tmp_path / "int4").glob("*.safetensors")) for t in scan_files([f])}
    expert = "model.layers.1.mlp.experts.3.down_proj.weight"
    assert (expert + ".absmax" in keys) == experts and expert in keys  # 4-bit with the flag, else kept 16-bit
    assert not [k for k in keys if k.rpartition(".")[2].startswith("weight_")]


def test_config_and_card_say_what_the_source_was(pairs, tmp_path):
    src, _ = pairs(*KIMI)
    prequant.convert(src, tmp_path / "out", device="cpu", progress=False, quantize_experts=True)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "bitsandbytes"
    assert "compressed-tensors INT4 pack-quantized (groups of 32)" in (tmp_path / "out" / "README.md").read_text()


def test_a_dry_run_plans_int4_weights_as_16_bit(pairs, tmp_path):
    src, ref = pairs(*KIMI)
    plan = prequant.convert(src, tmp_path / "unused", dry_run=True, quantize_experts=True).to_dict()
    assert plan == prequant.convert(ref, tmp_path / "unused", dry_run=True, quantize_experts=True).to_dict()


# ------------------------------------------------------------------------------------------------ refusals

DOWN = "model.layers.1.mlp.experts.1.down_proj"


def _edit(src: Path, change) -> None:
    """Rewrite the shard holding DOWN's parts with `change(tensors)` applied (a dict, edited in place)."""
    from safetensors.torch import load_file

    index = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    path = src / index[DOWN + ".weight_scale"]
    tensors = load_file(path)
    change(tensors)
    write_safetensors(path, dict(sorted(tensors.items(), key=lambda kv: -kv[1].element_size())))
    index = {**{k: v for k, v in index.items() if k in tensors or v != path.name},
             **{k: path.name for k in tensors}}
    (src / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))


def _refused(src: Path, out: Path) -> str:
    with pytest.raises(PrequantError) as e:
        prequant.convert(src, out, device="cpu", progress=False, quantize_experts=True)
    assert "\n" not in str(e.value)
    assert not out.exists() or not any(out.rglob("*.safetensors"))
    return str(e.value)


def _copy(pairs, tmp_path: Path, scheme=KIMI) -> Path:
    import shutil

    return Path(shutil.copytree(pairs(*scheme)[0], tmp_path / "src"))


def test_a_scale_of_the_wrong_shape_is_refused_naming_it(pairs, tmp_path):
    src = _copy(pairs, tmp_path)
    _edit(src, lambda t: t.update({DOWN + ".weight_scale": t[DOWN + ".weight_scale"][:, :-1].contiguous()}))
    message = _refused(src, tmp_path / "out")
    assert repr(DOWN + ".weight_scale") in message and "shape" in message and "[64, 1]" in message


def test_truncated_codes_are_refused_naming_the_tensor(pairs, tmp_path):
    src = _copy(pairs, tmp_path)
    index = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    from safetensors.torch import load_file

    path = src / index[DOWN + ".weight_packed"]
    tensors = load_file(path)
    tensors[DOWN + ".weight_packed"] = tensors[DOWN + ".weight_packed"][:, :-1].contiguous()
    order = [t.name for t in scan_files([path])]
    write_safetensors(path, {k: tensors[k] for k in order})
    message = _refused(src, tmp_path / "out")
    assert repr(DOWN + ".weight_packed") in message and "shape" in message
    assert "takes int32 [64, 4]" in message  # the codes' expected shape, [rows, ceil(cols/8)]
    assert "scale " + repr(DOWN + ".weight_scale") + " has" not in message  # the scale is not the one blamed


def test_a_weight_shape_that_disagrees_is_refused_naming_it(pairs, tmp_path):
    src = _copy(pairs, tmp_path)
    _edit(src, lambda t: t.update({DOWN + ".weight_shape": torch.tensor([64, 31])}))
    message = _refused(src, tmp_path / "out")
    assert repr(DOWN + ".weight_shape") in message and "[64, 31]" in message


def test_a_missing_zero_point_is_refused_naming_the_weight(pairs, tmp_path):
    src = _copy(pairs, tmp_path, ("group", False))
    _edit(src, lambda t: t.pop(DOWN + ".weight_zero_point"))
    message = _refused(src, tmp_path / "out")
    assert repr(DOWN + ".weight_packed") in message and "weight_zero_point" in message


def test_an_unknown_companion_is_refused_naming_it(pairs, tmp_path):
    """GPTQ's activation order (`weight_g_idx`) changes which scale a column takes: a formula prequant does not run."""
    src = _copy(pairs, tmp_path)
    _edit(src, lambda t: t.update({DOWN + ".weight_g_idx": torch.zeros(32, dtype=torch.int32)}))
    assert repr(DOWN + ".weight_g_idx") in _refused(src, tmp_path / "out")


@pytest.mark.parametrize("change, words", [
    ({"format": "nvfp4-pack-quantized"}, "compressed-tensors, format nvfp4-pack-quantized"),
    ({"format": "marlin-24"}, "compressed-tensors, format marlin-24"),
    ({"quant_method": "awq"}, "(awq"),
])
def test_an_unknown_format_is_refused_naming_it(pairs, tmp_path, change, words):
    src = _copy(pairs, tmp_path)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] |= change
    (src / "config.json").write_text(json.dumps(config))
    message = _refused(src, tmp_path / "out")
    assert words in message and "config.json" in message


@pytest.mark.parametrize("weights, words", [
    ({"num_bits": 8}, "num_bits 8"),
    ({"type": "float"}, "type 'float'"),
    ({"strategy": "block"}, "strategy 'block'"),
    ({"strategy": "tensor", "symmetric": False}, "asymmetric per-tensor"),
])
def test_an_unread_int4_scheme_is_refused_naming_it(pairs, tmp_path, weights, words):
    src = _copy(pairs, tmp_path)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["weights"] |= weights
    (src / "config.json").write_text(json.dumps(config))
    message = _refused(src, tmp_path / "out")
    assert words in message and "config_groups.group_0" in message


def test_verify_against_the_int4_source_compares_the_dequantized_weights(pairs, tmp_path):
    from prequant.verify import verify

    src, _ = pairs(*KIMI)
    prequant.convert(src, tmp_path / "out", device="cpu", progress=False, quantize_experts=True)
    report = verify(tmp_path / "out", source=src, progress=False)
    assert report.ok, report.to_dict()
    assert report.to_dict()["source"]["quantized"] > 24  # every expert compared with its dequantized source


def test_a_hub_int4_source_converts_as_the_local_one(hub_server, pairs, tmp_path):
    """From the Hub, shards streamed and evicted once converted: the scales, shapes and zero points the plan never
    names count as done with their weights."""
    import os

    src, _ = pairs("group", False)
    prequant.convert(src, tmp_path / "local", device="cpu", progress=False, max_shard_size="40KB")
    hub_server.add_repo("org/tiny-int4", {p.name: p for p in src.iterdir() if p.is_file()})
    prequant.convert("org/tiny-int4", tmp_path / "hub", device="cpu", progress=False, max_shard_size="40KB",
                     delete_source_shards=True)
    assert outputs(tmp_path / "hub") == outputs(tmp_path / "local")
    cache = Path(os.environ["HF_HOME"]) / "hub" / "models--org--tiny-int4"
    assert cache.is_dir() and not list(cache.glob("snapshots/*/*.safetensors"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("strategy, symmetric", SCHEMES)
def test_cuda_gives_the_cpu_bytes(pairs, tmp_path, strategy, symmetric):
    src, _ = pairs(strategy, symmetric)
    for device in ("cpu", "cuda"):
        prequant.convert(src, tmp_path / device, device=device, progress=False, quantize_experts=True)
    assert outputs(tmp_path / "cuda") == outputs(tmp_path / "cpu")


def test_a_weight_of_another_format_is_refused_naming_it(pairs, tmp_path):
    """An FP8 weight and its scale in a checkpoint that declares INT4 only: no format says how to read it."""
    src = _copy(pairs, tmp_path)
    w = torch.randn(64, 32).to(torch.float8_e4m3fn)
    _edit(src, lambda t: t.update({DOWN.replace("experts.1", "experts.9") + ".weight": w,
                                   DOWN.replace("experts.1", "experts.9") + ".weight_scale_inv": torch.ones(1, 1)}))
    message = _refused(src, tmp_path / "out")
    assert "experts.9.down_proj.weight" in message and "INT4" in message


def test_the_weight_shape_is_read_on_the_cpu_only(pairs):
    """The pipeline moves a weight's `read_with` to the quantizing device: codes, scale, zero point; its 16-byte
    weight_shape is checked from the mapped file (`check_stored`), yet is among the tensors read (`pieces`: a Hub
    source frees a shard by them)."""
    from prequant.checkpoint.quantized import pieces, read_with
    from prequant.checkpoint.tensors import QuantizedWeight
    from prequant.source.resolve import contents, resolve

    src, _ = pairs("group", False)
    refs = [t for t in contents(resolve(str(src))).tensors if isinstance(t, QuantizedWeight)]
    assert refs
    for ref in refs:
        module = ref.name.removesuffix(".weight")
        names = {part: f"{module}.weight_{part}" for part in ("packed", "scale", "shape", "zero_point")}
        assert [t.name for t in read_with(ref)] == [names["packed"], names["scale"], names["zero_point"]]
        assert [t.name for t in ref.checked] == [names["shape"]]
        assert [t.name for t in pieces(ref)] == list(names.values())
