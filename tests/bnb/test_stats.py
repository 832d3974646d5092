"""bnb.stats: dequantization and error statistics, against bitsandbytes' own CUDA outputs (the golden file)."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import DATA, gpu_only

import prequant
from prequant.bnb import stats


@pytest.mark.parametrize("case", ["nf4_dq64", "nf4_64", "fp4_dq64", "nf4_dq256"])
def test_dequantization_matches_bitsandbytes_cuda(case):
    """Golden CUDA outputs: our torch dequantization gives bitsandbytes' dequantize_4bit bit for bit."""
    from safetensors import safe_open

    with safe_open(DATA / "golden.safetensors", "pt") as f:
        cases = json.loads(f.metadata()["cases"])
        keys = set(f.keys())
        checked = 0
        for cv, state in cases.items():
            if not cv.endswith("/" + case) or f"{cv}/dequant" not in keys:
                continue
            def get(k: str, cv: str = cv) -> torch.Tensor | None:
                return f.get_tensor(f"{cv}/{k}") if f"{cv}/{k}" in keys else None

            source = f.get_tensor(cv.split("/")[0] + "/input")
            absmax = stats.dequantize_absmax(get("absmax"), get("nested_absmax"), get("nested_quant_map"),
                                             state.get("nested_offset", 0.0))
            ours = stats.dequantize(get("weight"), absmax, get("quant_map"), state["blocksize"], source.numel())
            assert torch.equal(ours.to(source.dtype), get("dequant").view(-1)), cv
            checked += 1
    assert checked


def test_entry_stats_of_a_gaussian_tensor_is_the_nf4_figure():
    """A Gaussian tensor's relative error is the table's figure; its block scales bound every element's error."""
    x = torch.randn(512, 512, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    st = stats.entry_stats(x, prequant.quantize_tensor(x))
    assert st.numel == x.numel() and st.finite
    assert abs(st.rel_error - stats.expected_rel_error("nf4", 64)) < 0.005
    assert st.error_ratio < 0.2 and 0 < st.absmax_min <= st.absmax_max


def test_non_finite_statistics_are_none_in_json():
    st = stats.TensorStats(4, 0.0, float("inf"), float("nan"), 1.0)
    assert not st.finite and st.to_dict()["absmax_max"] is None and st.to_dict()["rel_error"] is None


@pytest.mark.parametrize("scale", [1e30, 1e-30, 1e20, 1.0])
@pytest.mark.parametrize("storage", [torch.bfloat16, torch.uint8])
def test_finite_inputs_give_finite_statistics_at_any_scale(scale, storage):
    """Values near 1e30 square to 1e60, past float32: the figures must still be finite, and the same as at scale 1."""
    x = (torch.randn(256, 256, generator=torch.Generator().manual_seed(0)) * scale).to(torch.bfloat16)
    st = stats.entry_stats(x, prequant.quantize_tensor(x, quant_storage=storage))
    assert st.finite, st
    assert 0.08 < st.rel_error < 0.1 and 0.0 < st.error_ratio < 0.2
    assert st.to_dict()["rel_error"] is not None


@gpu_only
@pytest.mark.parametrize("scale", [1e30, 1e-30, 1.0])
@pytest.mark.parametrize("quant_type,storage,shape", [("nf4", torch.uint8, (300, 256)),
                                                      ("fp4", torch.bfloat16, (300, 255))])  # a partial last block
def test_gpu_figures_are_the_cpus(scale, quant_type, storage, shape):
    """On a GPU the values come from bitsandbytes' dequantization kernels: the same figures as the CPU's, block
    scales exactly, errors to float32 summation order, at any scale and for a tensor ending in a partial block."""
    x = (torch.randn(*shape, generator=torch.Generator().manual_seed(1)) * scale).to(torch.bfloat16)
    entries = prequant.quantize_tensor(x, quant_type=quant_type, quant_storage=storage)
    cpu = stats.entry_stats(x, entries)
    gpu = stats.entry_stats(x.cuda(), {k: v.cuda() for k, v in entries.items()})
    assert cpu.finite and 0.05 < cpu.rel_error < 0.15
    assert (gpu.numel, gpu.absmax_min, gpu.absmax_max) == (cpu.numel, cpu.absmax_min, cpu.absmax_max)
    assert gpu.rel_error == pytest.approx(cpu.rel_error, rel=1e-4)
    assert gpu.max_abs_error == pytest.approx(cpu.max_abs_error, rel=1e-4)


def test_double_quantized_scales_decode_in_the_states_nested_blocks():
    """The block scales' 8-bit codes decode as code * scale of their nested block + offset, in float32, with the
    nested block size the quant state names (bitsandbytes writes 256; a state may say otherwise)."""
    g = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 256, (1000,), dtype=torch.uint8, generator=g)
    nested_map = torch.linspace(-1, 1, 256)
    for blocksize in (128, 256):
        nested_absmax = torch.rand(-(-1000 // blocksize), generator=g) + 0.5
        wanted = nested_map[codes.long()] * nested_absmax.repeat_interleave(blocksize)[:1000] + 0.25
        assert torch.equal(stats.dequantize_absmax(codes, nested_absmax, nested_map, 0.25, blocksize), wanted)
