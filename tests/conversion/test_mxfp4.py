"""convert() of an MXFP4 source (gpt-oss's format: fused experts as `*_blocks` and `*_scales`, with bf16 biases)
equals, byte for byte, convert() of the 16-bit checkpoint transformers itself writes of it: `from_pretrained` with
`Mxfp4Config(dequantize=True)` on the CPU, then `save_pretrained` (`tests/quantized_checkpoints.py`). The experts stay
16-bit, as transformers holds them; --quantize-experts is refused; bad blocks and scales are refused in one line
naming the tensor, writing nothing."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from fp8_checkpoints import outputs, write_safetensors
from quantized_checkpoints import mxfp4_reference, mxfp4_source

import prequant
from prequant.checkpoint.reader import scan_files
from prequant.errors import PrequantError

GATE_UP = "model.layers.1.mlp.experts.gate_up_proj"


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    """(an MXFP4 source, transformers' dequantization of it saved), built once. The reference keeps the source's
    config.json and side files: what is compared is the tensors transformers dequantizes."""
    root = tmp_path_factory.mktemp("mxfp4")
    src = mxfp4_source(root)
    ref = mxfp4_reference(src, root / "ref")
    config = json.loads((src / "config.json").read_text())
    (ref / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "quantization_config"},
                                                indent=2))
    for extra in set(p.name for p in ref.iterdir()) - set(p.name for p in src.iterdir()):
        (ref / extra).unlink()
    return src, ref


def test_converting_mxfp4_is_converting_transformers_dequantization(pair, tmp_path):
    src, ref = pair
    prequant.convert(src, tmp_path / "mxfp4", device="cpu", progress=False, max_shard_size="100KB")
    prequant.convert(ref, tmp_path / "ref", device="cpu", progress=False, max_shard_size="100KB")
    got, wanted = outputs(tmp_path / "mxfp4"), outputs(tmp_path / "ref")
    assert len([n for n in got if n.endswith(".safetensors")]) > 1
    assert got.keys() == wanted.keys()
    for name in wanted:
        assert got[name] == wanted[name], name
    keys = {t.name: t for f in sorted((tmp_path / "mxfp4").glob("*.safetensors")) for t in scan_files([f])}
    assert keys[GATE_UP].dtype == "BF16" and keys[GATE_UP].shape == (4, 64, 256)  # [E, H, 2I], 16-bit
    assert GATE_UP + "_bias" in keys and "model.layers.0.self_attn.q_proj.weight.absmax" in keys
    assert not [k for k in keys if k.endswith(("_blocks", "_scales"))]


def test_the_card_says_mxfp4(pair, tmp_path):
    src, _ = pair
    prequant.convert(src, tmp_path / "out", device="cpu", progress=False)
    assert "MXFP4" in (tmp_path / "out" / "README.md").read_text()
    assert json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]["quant_method"] == (
        "bitsandbytes")


def test_quantized_experts_are_refused_in_one_line(pair, tmp_path):
    src, _ = pair
    with pytest.raises(PrequantError) as e:
        prequant.convert(src, tmp_path / "out", device="cpu", progress=False, quantize_experts=True)
    message = str(e.value)
    assert "\n" not in message and "fused experts (gpt-oss's" in message and "not supported in 4-bit" in message
    assert "experts.gate_up_proj" in message or "experts.down_proj" in message
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").rglob("*.safetensors"))


# ------------------------------------------------------------------------------------------------ refusals


def _broken(pair, tmp_path: Path, change) -> Path:
    """A copy of the source with `change(tensors)` applied to its one shard (a dict, edited in place)."""
    from safetensors.torch import load_file

    src = Path(shutil.copytree(pair[0], tmp_path / "src"))
    order = [t.name for t in scan_files([src / "model.safetensors"])]
    tensors = load_file(src / "model.safetensors")
    change(tensors)
    write_safetensors(src / "model.safetensors", {k: tensors[k] for k in order if k in tensors})
    return src


def _refused(src: Path, out: Path) -> str:
    with pytest.raises(PrequantError) as e:
        prequant.convert(src, out, device="cpu", progress=False)
    assert "\n" not in str(e.value)
    assert not out.exists() or not any(out.rglob("*.safetensors"))
    return str(e.value)


@pytest.mark.parametrize("cut", ["bytes", "groups"])
def test_truncated_blocks_are_refused_naming_them(pair, tmp_path, cut):
    def change(t):
        b = t[GATE_UP + "_blocks"]
        t[GATE_UP + "_blocks"] = (b[..., :15] if cut == "bytes" else b[:, :, :1]).contiguous()

    message = _refused(_broken(pair, tmp_path, change), tmp_path / "out")
    assert repr(GATE_UP + ("_blocks" if cut == "bytes" else "_scales")) in message and "[4, 256, " in message


def test_scales_of_the_wrong_shape_are_refused_naming_them(pair, tmp_path):
    def change(t):
        t[GATE_UP + "_scales"] = t[GATE_UP + "_scales"][:, :128].contiguous()

    message = _refused(_broken(pair, tmp_path, change), tmp_path / "out")
    assert repr(GATE_UP + "_scales") in message and "[4, 128, 2]" in message and "[4, 256, 2]" in message


def test_blocks_without_scales_are_refused_naming_them(pair, tmp_path):
    message = _refused(_broken(pair, tmp_path, lambda t: t.pop(GATE_UP + "_scales")), tmp_path / "out")
    assert repr(GATE_UP + "_blocks") in message and "_scales" in message


def test_scales_without_blocks_are_refused_naming_them(pair, tmp_path):
    message = _refused(_broken(pair, tmp_path, lambda t: t.pop(GATE_UP + "_blocks")), tmp_path / "out")
    assert repr(GATE_UP + "_scales") in message


def test_scales_of_another_dtype_are_refused_naming_them(pair, tmp_path):
    def change(t):
        t[GATE_UP + "_scales"] = t[GATE_UP + "_scales"].to(torch.bfloat16)

    message = _refused(_broken(pair, tmp_path, change), tmp_path / "out")
    assert repr(GATE_UP + "_scales") in message and "BF16" in message


def test_every_code_at_every_exponent_is_transformers_value(tmp_path, monkeypatch):
    """Every byte (two codes) at every e8m0 exponent, 0 and 255 included, against transformers'
    `convert_moe_packed_tensors` itself, in bf16 (gpt-oss's dtype): the same bits, NaN where it is; dequantized in
    several pieces of rows on two CPU threads (as the pipeline runs a large weight)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from prequant.bnb.kernels import _parallel
    from prequant.checkpoint import lookup, mxfp4
    from prequant.checkpoint.tensors import BIN_OFFSET, QuantizedWeight, TensorRef

    # every byte once a row, rotated by row and expert: no two rows alike, so a piece of the wrong rows shows
    shift = torch.arange(256).reshape(1, 256, 1, 1) + 7 * torch.arange(2).reshape(2, 1, 1, 1)
    blocks = (torch.arange(256).reshape(1, 1, 16, 16) + shift).remainder(256).to(torch.uint8)
    scales = torch.arange(256, dtype=torch.uint8).reshape(1, 256, 1).expand(2, 256, 16).contiguous()
    stored = TensorRef("x_blocks", "U8", tuple(blocks.shape), tmp_path, 0, blocks.numel())
    scale = TensorRef("x_scales", "U8", tuple(scales.shape), tmp_path, 0, scales.numel())
    ref = QuantizedWeight("x", "BF16", (2, 512, 256), tmp_path, BIN_OFFSET, 2 * 2 * 512 * 256, stored, scale,
                          mxfp4.METHOD, None)
    monkeypatch.setattr(lookup, "CPU_PIECE", 100 * 512)  # 100 rows of 512 columns a piece: 3 an expert
    monkeypatch.setattr(_parallel, "THREADS", 2)
    pieces: list[int] = []

    def on_threads(count, work):
        pieces.append(count)
        _parallel.run(count, work)

    got = mxfp4.dequantize(ref, blocks, scales, each=on_threads)
    assert pieces and min(pieces) > 1
    wanted = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)
    assert got.shape == wanted.shape and got.dtype == wanted.dtype
    nan = wanted.isnan()
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(got[~nan].view(torch.int16), wanted[~nan].view(torch.int16))


def test_verify_against_the_mxfp4_source_compares_the_dequantized_experts(pair, tmp_path):
    from prequant.verify import verify

    prequant.convert(pair[0], tmp_path / "out", device="cpu", progress=False)
    report = verify(tmp_path / "out", source=pair[0], progress=False)
    assert report.ok, report.to_dict()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_gives_the_cpu_bytes(pair, tmp_path):
    for device in ("cpu", "cuda"):
        prequant.convert(pair[0], tmp_path / device, device=device, progress=False)
    assert outputs(tmp_path / "cuda") == outputs(tmp_path / "cpu")


def test_a_weight_of_another_format_is_refused_naming_it(pair, tmp_path):
    """INT4 codes in a checkpoint that declares MXFP4 only: no format says how to read them."""
    def change(t):
        t["model.layers.0.self_attn.q_proj.weight_packed"] = torch.zeros(64, 8, dtype=torch.int32)

    from safetensors.torch import load_file

    src = Path(shutil.copytree(pair[0], tmp_path / "src"))
    tensors = load_file(src / "model.safetensors")
    change(tensors)
    write_safetensors(src / "model.safetensors", dict(sorted(tensors.items(), key=lambda kv: -kv[1].element_size())))
    message = _refused(src, tmp_path / "out")
    assert "'model.layers.0.self_attn.q_proj.weight_packed'" in message and "MXFP4" in message
