"""`prequant merge --device cuda` (run with `-m gpu`): into a 4-bit base, bitsandbytes' own CUDA dequantization gives
the bytes prequant's CPU reproduction gives, and the merged weights agree with the CPU merge but for the rare float32
product that cuBLAS sums in another order; LoRA on fused MoE experts too."""

from __future__ import annotations

import torch
from adapters import make_adapter
from helpers import gpu_only, read_checkpoint

import prequant


@gpu_only
def test_merge_on_the_gpu_gives_the_cpus_bytes_but_for_rare_float32_product_roundings(checkpoints, tmp_path):
    base = checkpoints("llama")
    converted = tmp_path / "nf4"
    prequant.convert(base, converted, device="cpu", progress=False)
    adapter = make_adapter(base, tmp_path / "adapter", target_modules=["q_proj", "down_proj"])
    for device in ("cpu", "cuda"):
        prequant.merge(adapter, tmp_path / device, base=converted, device=device, progress=False)
    cpu, gpu = read_checkpoint(tmp_path / "cpu"), read_checkpoint(tmp_path / "cuda")
    assert set(cpu) == set(gpu)
    for key in cpu:
        if ".q_proj." in key or ".down_proj." in key:  # merged: W + delta, the delta's products from cuBLAS
            differ = (cpu[key].view(torch.int16) != gpu[key].view(torch.int16)).float().mean().item()
            assert differ <= 1e-3, key
            assert ((cpu[key].float() - gpu[key].float()).abs() <= cpu[key].float().abs() * 2**-7 + 2**-133).all()
        else:  # dequantized only: bitsandbytes' CUDA kernel, byte for byte
            assert torch.equal(cpu[key].view(torch.uint8), gpu[key].view(torch.uint8)), key


@gpu_only
def test_lora_on_fused_experts_merges_on_the_gpu_as_on_the_cpu(tmp_path):
    """Each expert's share of a fused parameter's LoRA, taken on the host and merged on the GPU into its dequantized
    4-bit expert (`--quantize-experts` base): the CPU's bytes but for rare float32 product roundings."""
    from moe_checkpoints import build_moe

    base = build_moe("mixtral", tmp_path / "base")
    converted = tmp_path / "nf4"
    prequant.convert(base, converted, device="cpu", progress=False, quantize_experts=True)
    adapter = make_adapter(base, tmp_path / "adapter", target_modules=["w1", "w3", "w2"])
    for device in ("cpu", "cuda"):
        prequant.merge(adapter, tmp_path / device, base=converted, device=device, progress=False)
    cpu, gpu = read_checkpoint(tmp_path / "cpu"), read_checkpoint(tmp_path / "cuda")
    assert set(cpu) == set(gpu) and any(".experts." in k for k in cpu)
    for key in cpu:
        differ = (cpu[key].view(torch.int16) != gpu[key].view(torch.int16)).float().mean().item()
        assert differ <= 1e-3, key
        assert ((cpu[key].float() - gpu[key].float()).abs() <= cpu[key].float().abs() * 2**-7 + 2**-133).all(), key
