"""GPU tests of the conversion: bytes equal to transformers + bitsandbytes on CUDA; run them on a CUDA machine.

    python -m pytest -q -m gpu tests/conversion/test_convert_gpu.py
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from fp8_checkpoints import fp8_pair, outputs
from helpers import MIXES, build_checkpoint, gpu_only, read_checkpoint, retyped, run_cli, transformers_reference
from moe_checkpoints import HANDLED, build_moe

import prequant


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    src = build_checkpoint("llama", tmp_path_factory.mktemp("gpu-src"))
    ref = transformers_reference(src, tmp_path_factory.mktemp("gpu-ref"), device="cuda")
    return src, ref


def _assert_identical_checkpoints(a: Path, b: Path) -> None:
    ta, tb = read_checkpoint(a), read_checkpoint(b)
    assert sorted(ta) == sorted(tb)
    for k in ta:
        assert _same_bytes(ta[k], tb[k]), k
    ca, cb = (json.loads((d / "config.json").read_text()) for d in (a, b))
    assert ca["quantization_config"] == cb["quantization_config"]


@gpu_only
def test_cuda_convert_is_byte_identical_to_transformers(tiny, tmp_path):
    src, ref = tiny
    prequant.convert(src, tmp_path / "out", device="cuda", progress=False)
    _assert_identical_checkpoints(tmp_path / "out", ref)


@gpu_only
def test_cpu_convert_is_byte_identical_to_transformers_on_cuda(tiny, tmp_path):
    src, ref = tiny
    prequant.convert(src, tmp_path / "out", device="cpu", progress=False)
    _assert_identical_checkpoints(tmp_path / "out", ref)


@gpu_only
def test_auto_converts_a_tiny_checkpoint_on_the_cpu_to_the_same_bytes(tiny, tmp_path):
    src, ref = tiny
    summary = prequant.convert(src, tmp_path / "out", device="auto", progress=False)
    assert summary.device == "cpu"
    _assert_identical_checkpoints(tmp_path / "out", ref)


@gpu_only
def test_cuda_logits_identical_to_on_the_fly_quantization(tiny, tmp_path):
    from helpers import bnb_config
    from transformers import AutoModelForCausalLM

    src, _ = tiny
    prequant.convert(src, tmp_path / "out", device="cuda", progress=False)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0)).cuda()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out", device_map="cuda")
    fly = AutoModelForCausalLM.from_pretrained(src, quantization_config=bnb_config(), device_map="cuda")
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, fly(ids).logits)


@gpu_only
def test_real_size_layer_is_byte_identical_to_transformers(tmp_path):
    """One Llama-3-8B-sized decoder layer (4096 x 14336 MLP), converted on the GPU and on the CPU."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=1, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=512,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(tmp_path / "src")
    ref = transformers_reference(tmp_path / "src", tmp_path / "ref", device="cuda")
    prequant.convert(tmp_path / "src", tmp_path / "cuda", device="cuda", progress=False)
    _assert_identical_checkpoints(tmp_path / "cuda", ref)
    prequant.convert(tmp_path / "src", tmp_path / "cpu", device="cpu", progress=False)
    _assert_identical_checkpoints(tmp_path / "cpu", ref)


@gpu_only
@pytest.mark.parametrize("mix", ["fp32-in-bf16", "fp16-in-bf16", "mixed"])
@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_tensors_in_other_dtypes_are_byte_identical_to_transformers(tiny, tmp_path, mix, device):
    """Weights stored in fp32 or fp16 in a bf16 model: cast as transformers casts them, then quantized."""
    src = retyped(tiny[0], tmp_path / "src", MIXES[mix])
    ref = transformers_reference(src, tmp_path / "ref", device="cuda")
    prequant.convert(src, tmp_path / "out", device=device, progress=False)
    _assert_identical_checkpoints(tmp_path / "out", ref)


@gpu_only
@pytest.mark.parametrize("kind", HANDLED)
def test_quantized_experts_on_cuda_are_the_cpu_kernels_bytes(tmp_path, kind):
    src = build_moe(kind, tmp_path / "src")
    for device in ("cuda", "cpu"):
        prequant.convert(src, tmp_path / device, device=device, progress=False, quantize_experts=True)
    assert outputs(tmp_path / "cuda") == outputs(tmp_path / "cpu")


@gpu_only
@pytest.mark.parametrize("fmt, scale_dtype", [("block", torch.float32), ("block", torch.bfloat16),
                                              ("channel", torch.bfloat16), ("tensor", torch.float32)])
def test_fp8_on_cuda_is_the_reference_dequantization_converted_and_the_cpu_bytes(tmp_path, fmt, scale_dtype):
    """Both FP8 formats, dimensions not multiples of the block, a weight and its scale in different shards: on CUDA
    the output equals converting (on CUDA) the 16-bit checkpoint the reference dequantization writes, and the CPU's."""
    src, ref = fp8_pair(tmp_path, fmt, scale_dtype)
    for name, source, device in (("fp8-cuda", src, "cuda"), ("fp8-cpu", src, "cpu"), ("ref-cuda", ref, "cuda")):
        prequant.convert(source, tmp_path / name, device=device, progress=False, max_shard_size="150KB")
    wanted = outputs(tmp_path / "ref-cuda")
    assert len([n for n in wanted if n.endswith(".safetensors")]) > 1
    assert outputs(tmp_path / "fp8-cuda") == wanted
    assert outputs(tmp_path / "fp8-cpu") == wanted


DOWN_PROJ = "model.layers.1.mlp.down_proj.weight"


@gpu_only
@pytest.mark.parametrize("bad", ["nan", "inf", "block scales too large"])
def test_a_tensor_the_quantizer_refuses_on_cuda_stops_the_conversion_by_name(tmp_path, bad):
    """On a GPU the quantizer's check (a flag and the double quant's offset, read from the device) stops the
    conversion at that tensor with its one-line error, and nothing looks complete."""
    from safetensors.torch import load_file, save_file

    src = build_checkpoint("llama", tmp_path / "src")
    tensors = load_file(src / "model.safetensors")
    w = tensors[DOWN_PROJ]
    if bad == "block scales too large":
        w.fill_(3e38)  # float32's sum of the block scales overflows: the double quant's offset is Inf
    else:
        w.view(-1)[777] = float(bad)
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "out"
    proc = run_cli("convert", str(src), str(out), "--device", "cuda", env={"PREQUANT_DEBUG": ""})
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and DOWN_PROJ in lines[0], proc.stderr
    assert ("too large for double quantization" if bad.startswith("block") else "NaN or Inf") in lines[0]
    assert not list(out.glob("*.safetensors")) and not (out / "config.json").exists()


@gpu_only
def test_cuda_statistics_are_the_cpus_figures(tiny, tmp_path):
    """A conversion's statistics on the GPU (bitsandbytes' dequantization) are the CPU's: the block scales' range
    exactly, the errors to float32 summation order."""
    src, _ = tiny
    manifests = {}
    for device in ("cuda", "cpu"):
        prequant.convert(src, tmp_path / device, device=device, progress=False)
        manifests[device] = json.loads((tmp_path / device / "prequant.json").read_text())
    gpu, cpu = manifests["cuda"]["tensors"], manifests["cpu"]["tensors"]
    assert gpu.keys() == cpu.keys() and gpu and manifests["cuda"]["stats"]["complete"]
    for name, g in gpu.items():
        c = cpu[name]
        assert (g["numel"], g["absmax_min"], g["absmax_max"]) == (c["numel"], c["absmax_min"], c["absmax_max"]), name
        assert g["rel_error"] == pytest.approx(c["rel_error"], rel=1e-4), name
        assert g["max_abs_error"] == pytest.approx(c["max_abs_error"], rel=1e-4), name
