"""FP8 sources converted on CUDA: float8 weights and their scales go to the GPU as stored and are dequantized there, and
the output has the bytes of the CPU conversion and of the converted 16-bit checkpoint the reference dequantization
writes (`tests/fp8_checkpoints.py`: both formats, edge blocks, a weight and its scale in different shards). Run the
GPU ones on a CUDA machine:

    python -m pytest -q -m gpu tests/conversion/test_fp8_device.py
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from fp8_checkpoints import fp8_pair, outputs
from helpers import GPU, gpu_only, run_cli

import prequant
from prequant.checkpoint import fp8
from prequant.checkpoint.tensors import BIN_OFFSET, QuantizedWeight, TensorRef

CASES = [("block", torch.float32), ("block", torch.bfloat16), ("channel", torch.bfloat16), ("channel", torch.float16),
         ("tensor", torch.float32)]


def _convert(src: Path, out: Path, device: str, **options: object) -> dict[str, bytes]:
    prequant.convert(src, out, device=device, progress=False, max_shard_size="150KB", **options)
    return outputs(out)


@gpu_only
@pytest.mark.parametrize("fmt, scale_dtype", CASES)
def test_cuda_conversion_is_the_cpu_one_and_the_references(tmp_path, fmt, scale_dtype):
    src, ref = fp8_pair(tmp_path, fmt, scale_dtype)
    cuda = _convert(src, tmp_path / "cuda", "cuda")
    assert len([n for n in cuda if n.endswith(".safetensors")]) > 1
    assert cuda == _convert(src, tmp_path / "cpu", "cpu")
    assert cuda == _convert(ref, tmp_path / "ref", "cuda")


@gpu_only
@pytest.mark.parametrize("fmt, scale_dtype", CASES[1:3])
def test_a_kept_fp8_weight_is_dequantized_on_cuda_as_on_the_cpu(tmp_path, fmt, scale_dtype):
    src, ref = fp8_pair(tmp_path, fmt, scale_dtype)
    skip = ["model.layers.0.mlp.down_proj", "model.layers.1.self_attn.q_proj"]
    cuda = _convert(src, tmp_path / "cuda", "cuda", skip=skip)
    assert cuda == _convert(src, tmp_path / "cpu", "cpu", skip=skip)
    assert cuda == _convert(ref, tmp_path / "ref", "cuda", skip=skip)


@gpu_only
@pytest.mark.parametrize("shape, method", [((7168, 2048), fp8.BLOCK), ((18432, 7168), fp8.BLOCK),
                                           ((18000, 7100), fp8.BLOCK), ((18432, 7168), fp8.CT)])
def test_real_size_weights_dequantize_on_cuda_to_the_cpu_bytes(shape, method):
    """DeepSeek-V3's expert and dense shapes (and one with edge blocks): several pieces on the GPU, every float8 code;
    the CPU side on its kernel's threads, as the pipeline runs it."""
    from prequant.bnb.kernels import _parallel

    rows, cols = shape
    g = torch.Generator().manual_seed(0)
    weight = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8).view(torch.float8_e4m3fn)
    scale = torch.rand((-(-rows // 128), -(-cols // 128)) if method == fp8.BLOCK else (rows, 1), generator=g) + 1e-3
    stored = TensorRef("w", "F8_E4M3", shape, Path("w"), 0, math.prod(shape))
    scales = TensorRef("s", "F32", tuple(scale.shape), Path("w"), 0, scale.numel() * 4)
    ref = QuantizedWeight("w", "BF16", shape, Path("w"), BIN_OFFSET, 2 * math.prod(shape), stored, scales, method,
                        (128, 128) if method == fp8.BLOCK else None)
    cpu = fp8.dequantize(ref, weight, scale, each=_parallel.run)
    cuda = fp8.dequantize(ref, weight.cuda(), scale.cuda())
    assert cuda.device.type == "cuda" and cuda.dtype == torch.bfloat16
    cuda = cuda.cpu()
    nan = cpu.isnan()  # NaN's bits are each device's choice; NaN where it is
    assert nan.any() and torch.equal(cuda.isnan(), nan)
    assert torch.equal(cuda[~nan].view(torch.int16), cpu[~nan].view(torch.int16))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=GPU)])
def test_fp8_weights_are_dequantized_in_the_quantizing_stage(tmp_path, device):
    """The reader hands over float8 bytes and scales as stored; the quantizing stage dequantizes them on `device`
    (its own time in PREQUANT_TRACE, which the benchmarks read)."""
    src, _ = fp8_pair(tmp_path, "block", torch.float32)
    trace = tmp_path / "trace.json"
    run_cli("convert", str(src), str(tmp_path / "out"), "--device", device, env={"PREQUANT_TRACE": str(trace)},
            check=True)
    assert json.loads(trace.read_text())["busy"]["dequantize"] > 0
