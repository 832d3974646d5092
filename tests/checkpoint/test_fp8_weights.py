"""FP8 weights read as 16-bit tensors (`checkpoint.quantized`, `checkpoint.fp8`): the same bytes as each reference dequantization, scales and
activation parameters folded away, and every layout prequant cannot read refused in one line naming the tensor."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from fp8_checkpoints import (
    block_quantize,
    ct_dequantize,
    ct_quantize,
    deepseek_weight_dequant,
    fp8_pair,
    write_checkpoint,
)

from prequant.checkpoint import fp8, lookup, quantized
from prequant.checkpoint.tensors import QuantizedWeight
from prequant.checkpoint.hf_files import read_config
from prequant.checkpoint.reader import TensorReader
from prequant.errors import PrequantError
from prequant.source.resolve import contents, resolve

BF16_LLAMA = {"model_type": "llama", "dtype": "bfloat16"}
BLOCK_QC = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}
CT_QC = {"quant_method": "compressed-tensors", "format": "float-quantized"}


def _weight(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # magnitudes that differ by block and by row: every scale different
    return (torch.randn(rows, cols, generator=g) * torch.rand(rows, 1, generator=g) * 3).to(torch.bfloat16)


def _read(tmp_path: Path, tensors: dict[str, torch.Tensor], qc: dict,
          config: dict | None = None) -> dict[str, torch.Tensor]:
    """The checkpoint of `tensors` read back through contents() and TensorReader: name -> tensor as the plan sees it."""
    aligned = dict(sorted(tensors.items(), key=lambda kv: -kv[1].element_size()))
    src = write_checkpoint(tmp_path / "src", [aligned], (config or BF16_LLAMA) | {"quantization_config": qc})
    held = contents(resolve(str(src)))
    with TensorReader() as r:
        return {t.name: r.view(t).clone() for t in held.tensors}


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("shape", [(300, 200), (128, 256), (77, 129), (1, 5)])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("model_dtype", ["bfloat16", "float16", "float32"])
def test_block_scaled_is_deepseeks_weight_dequant(tmp_path, shape, scale_dtype, model_dtype):
    q, s = block_quantize(_weight(*shape), (128, 128), scale_dtype)
    got = _read(tmp_path, {"m.weight": q, "m.weight_scale_inv": s}, BLOCK_QC, {"dtype": model_dtype})
    assert list(got) == ["m.weight"]  # the scale is folded into its weight
    assert _same(got["m.weight"], deepseek_weight_dequant(q, s, getattr(torch, model_dtype)))


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
def test_block_scaled_is_transformers_fp8_dequantize_where_blocks_divide_the_weight(tmp_path, scale_dtype):
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    q, s = block_quantize(_weight(256, 384, seed=3), (128, 128), scale_dtype)
    got = _read(tmp_path, {"m.weight": q, "m.weight_scale_inv": s}, BLOCK_QC)["m.weight"]
    assert _same(got, Fp8Dequantize(None)._dequantize_one(q, s, output_dtype=torch.bfloat16))


def test_non_square_blocks(tmp_path):
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    q, s = block_quantize(_weight(256, 256, seed=4), (64, 128), torch.float32)
    got = _read(tmp_path, {"m.weight": q, "m.weight_scale_inv": s}, BLOCK_QC | {"weight_block_size": [64, 128]})
    assert _same(got["m.weight"], Fp8Dequantize(None)._dequantize_one(q, s, output_dtype=torch.bfloat16))


@pytest.mark.parametrize("per", ["tensor", "channel"])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("model_dtype", ["bfloat16", "float16"])
def test_compressed_tensors_is_its_own_decompression(tmp_path, per, scale_dtype, model_dtype):
    q, s = ct_quantize(_weight(300, 200, seed=1), per, scale_dtype)
    got = _read(tmp_path, {"m.weight": q, "m.weight_scale": s, "m.input_scale": torch.ones(1)}, CT_QC,
                {"dtype": model_dtype})
    assert list(got) == ["m.weight"]  # scale and input_scale folded away
    assert _same(got["m.weight"], ct_dequantize(q, s, getattr(torch, model_dtype)))


def test_a_16_bit_scale_of_another_dtype_is_rounded_as_compressed_tensors_rounds(tmp_path):
    """compressed-tensors computes in the scale's dtype: a float16 scale in a bfloat16 model rounds twice. The rule
    written once (the float32 product rounded to bfloat16) would give other bytes: the test can tell them apart."""
    q, s = ct_quantize(_weight(300, 200, seed=2), "channel", torch.float16)
    got = _read(tmp_path, {"m.weight": q, "m.weight_scale": s}, CT_QC)["m.weight"]
    once = (q.float() * s.float()).to(torch.bfloat16)
    assert _same(got, ct_dequantize(q, s, torch.bfloat16)) and not _same(got, once)


@pytest.mark.parametrize("fmt, scale_dtype", [("block", torch.float32), ("channel", torch.bfloat16),
                                               ("tensor", torch.float32)])
def test_a_weight_of_many_pieces_is_the_reference_on_threads_too(tmp_path, monkeypatch, fmt, scale_dtype):
    """Every float8 code (NaN, -0 and subnormals among them) in a weight wide enough to be dequantized in several
    pieces of rows, whose edges fall inside 128-row blocks: the same bytes one piece after another and on the CPU
    kernel's threads (as the pipeline runs it)."""
    from prequant.bnb.kernels import _parallel

    rows, cols = 300, 4100
    q = torch.arange(rows * cols).remainder(256).to(torch.uint8)[torch.randperm(rows * cols)]
    q = q.view(torch.float8_e4m3fn).reshape(rows, cols)
    g = torch.Generator().manual_seed(5)
    if fmt == "block":
        s = (torch.rand(3, 33, generator=g) + 0.01).to(scale_dtype)
        tensors, qc, wanted = {"m.weight": q, "m.weight_scale_inv": s}, BLOCK_QC, deepseek_weight_dequant(
            q, s, torch.bfloat16)
    else:
        s = (torch.rand(*((rows, 1) if fmt == "channel" else (1,)), generator=g) + 0.01).to(scale_dtype)
        tensors, qc, wanted = {"m.weight": q, "m.weight_scale": s}, CT_QC, ct_dequantize(q, s, torch.bfloat16)
    src = write_checkpoint(tmp_path / "src", [dict(sorted(tensors.items(), key=lambda kv: -kv[1].element_size()))],
                           BF16_LLAMA | {"quantization_config": qc})
    (ref,) = contents(resolve(str(src))).tensors
    assert lookup.CPU_PIECE // cols < 128 and rows > lookup.CPU_PIECE // cols  # several pieces, edges inside blocks
    monkeypatch.setattr(_parallel, "THREADS", 2)
    pieces: list[int] = []

    def on_threads(count, work):
        pieces.append(count)
        _parallel.run(count, work)

    with TensorReader() as r:
        for got in (r.view(ref), fp8.dequantize(ref, r.view(ref.stored), r.view(ref.scale), each=on_threads)):
            # NaN's bits are torch's choice (even the reference's vector and scalar loops differ): NaN where it is
            nan = wanted.isnan()
            assert nan.sum() == 2 * rows * cols // 256 and torch.equal(got.isnan(), nan)
            assert _same(got[~nan], wanted[~nan])
    assert pieces and pieces[0] > 1


def test_as_16bit_folds_scales_and_activation_parameters_into_their_weights(tmp_path):
    src, ref = fp8_pair(tmp_path, "channel", torch.bfloat16)
    fp8_held, ref_held = contents(resolve(str(src))), contents(resolve(str(ref)))
    assert [(t.name, t.dtype, t.shape, t.nbytes) for t in fp8_held.tensors] == [
        (t.name, t.dtype, t.shape, t.nbytes) for t in ref_held.tensors]
    assert "quantization_config" not in fp8_held.config and fp8_held.config == ref_held.config
    weights = [t for t in fp8_held.tensors if isinstance(t, QuantizedWeight)]
    assert len(weights) == 14 and all(t.stored.dtype == "F8_E4M3" for t in weights)
    q = next(t for t in weights if t.name == "model.layers.0.self_attn.q_proj.weight")
    assert q.scale.name.endswith("q_proj.weight_scale") and q.scale.file != q.stored.file  # in the other shard
    assert [r.name for r in q.riders] == ["model.layers.0.self_attn.q_proj.input_scale"]
    # Every stored tensor is read or dropped with exactly one tensor of the plan: a Hub source frees shards by them.
    from prequant.checkpoint.reader import scan_files

    on_disk = scan_files(sorted(src.glob("*.safetensors")))
    assert sorted(t.name for t in quantized.stored(fp8_held.tensors)) == sorted(t.name for t in on_disk)


def test_a_source_without_fp8_comes_back_as_it_is(tmp_path):
    _, ref = fp8_pair(tmp_path, "block", torch.float32)
    held = contents(resolve(str(ref)))
    assert not any(isinstance(t, QuantizedWeight) for t in held.tensors)
    assert quantized.as_16bit(held.tensors, held.config) == (held.tensors, held.config)


# ------------------------------------------------------------------------------------------------ refusals


def _refused(tmp_path: Path, tensors: dict[str, torch.Tensor], qc: dict, config: dict | None = None) -> str:
    with pytest.raises(PrequantError) as e:
        _read(tmp_path, tensors, qc, config)
    message = str(e.value)
    assert "\n" not in message
    return message


def test_e5m2_weights_are_refused(tmp_path):
    q, s = block_quantize(_weight(130, 130), (128, 128), torch.float32)
    message = _refused(tmp_path, {"m.weight": q.float().to(torch.float8_e5m2), "m.weight_scale_inv": s}, BLOCK_QC)
    assert "'m.weight'" in message and "F8_E5M2" in message


def test_a_float8_weight_without_its_scale_is_refused(tmp_path):
    q, s = block_quantize(_weight(130, 130), (128, 128), torch.float32)
    message = _refused(tmp_path, {"m.weight": q, "n.weight_scale_inv": s}, BLOCK_QC)
    assert "'m.weight'" in message and "weight_scale_inv" in message


@pytest.mark.parametrize("fmt", ["block", "ct"])
def test_a_scale_of_the_wrong_shape_is_refused(tmp_path, fmt):
    if fmt == "block":
        q, s = block_quantize(_weight(130, 130), (128, 128), torch.float32)
        tensors, qc = {"m.weight": q, "m.weight_scale_inv": s[:1]}, BLOCK_QC
    else:
        q, s = ct_quantize(_weight(130, 130), "channel", torch.bfloat16)
        tensors, qc = {"m.weight": q, "m.weight_scale": s.reshape(1, -1)}, CT_QC
    message = _refused(tmp_path, tensors, qc)
    assert "'m.weight_scale" in message and "'m.weight'" in message and "shape" in message


@pytest.mark.parametrize("extra", [
    {"m.weight_zero_point": torch.zeros(130, 1, dtype=torch.bfloat16)},  # asymmetric: another formula
    {"m.weight_shape_original": torch.tensor([130, 130])},  # compressed-tensors' padded blocks
    {"n.weight_scale": torch.ones(1), "n.weight": torch.ones(4, 4, dtype=torch.bfloat16)},  # a scale of a 16-bit weight
])
def test_unknown_companions_are_refused(tmp_path, extra):
    q, s = ct_quantize(_weight(130, 130), "channel", torch.bfloat16)
    message = _refused(tmp_path, {"m.weight": q, "m.weight_scale": s, **extra}, CT_QC)
    assert repr(next(k for k in extra if "weight_" in k)) in message


def test_a_scale_of_an_unknown_dtype_is_refused(tmp_path):
    q, s = block_quantize(_weight(130, 130), (128, 128), torch.float32)
    message = _refused(tmp_path, {"m.weight": q, "m.weight_scale_inv": s.to(torch.uint8)}, BLOCK_QC)
    assert "'m.weight_scale_inv'" in message and "U8" in message


@pytest.mark.parametrize("qc, config, words", [
    (BLOCK_QC | {"weight_block_size": None}, None, "weight_block_size"),
    (BLOCK_QC | {"fmt": "e5m2"}, None, "fmt"),
    (BLOCK_QC, {"model_type": "llama"}, "torch_dtype"),
])
def test_unreadable_declarations_are_refused(tmp_path, qc, config, words):
    q, s = block_quantize(_weight(130, 130), (128, 128), torch.float32)
    message = _refused(tmp_path, {"m.weight": q, "m.weight_scale_inv": s}, qc, config)
    assert words in message and "config.json" in message


def test_a_declaration_without_float8_weights_is_refused(tmp_path):
    message = _refused(tmp_path, {"m.weight": _weight(4, 4)}, BLOCK_QC)
    assert "no tensor is float8" in message


@pytest.mark.parametrize("qc", [
    {"quant_method": "bitsandbytes", "load_in_4bit": True},
    {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized"},
    {"quant_method": "gptq", "bits": 4},
])
def test_other_quantized_sources_are_still_refused(tmp_path, qc):
    shutil.rmtree(tmp_path, ignore_errors=True)
    tmp_path.mkdir()
    (tmp_path / "config.json").write_text(json.dumps(BF16_LLAMA | {"quantization_config": qc}))
    with pytest.raises(PrequantError, match=rf"already quantized \({qc['quant_method']}[,)]") as e:
        read_config(tmp_path)
    assert qc.get("format", "") in str(e.value) and "\n" not in str(e.value)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("fmt", ["block", "channel", "tensor"])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dequantizing_on_cuda_gives_the_cpu_bytes(tmp_path, fmt, scale_dtype):
    if fmt == "block":
        q, s = block_quantize(_weight(300, 200), (128, 128), scale_dtype)
        tensors, qc = {"m.weight": q, "m.weight_scale_inv": s}, BLOCK_QC
    else:
        q, s = ct_quantize(_weight(300, 200), fmt, scale_dtype)
        tensors, qc = {"m.weight": q, "m.weight_scale": s}, CT_QC
    src = write_checkpoint(tmp_path / "src", [dict(sorted(tensors.items(), key=lambda kv: -kv[1].element_size()))],
                           BF16_LLAMA | {"quantization_config": qc})
    (ref,) = contents(resolve(str(src))).tensors
    with TensorReader() as r:
        cpu = r.view(ref)
        cuda = fp8.dequantize(ref, r.view(ref.stored).cuda(), r.view(ref.scale).cuda())
    assert cuda.device.type == "cuda" and _same(cuda.cpu(), cpu)
