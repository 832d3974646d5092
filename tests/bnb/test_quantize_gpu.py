"""GPU tests of the quantizer: bitsandbytes' CUDA kernel is the reference; run them on a CUDA machine.

    python -m pytest -q -m gpu tests/bnb/test_quantize_gpu.py

Every test here needs CUDA except the CPU parametrization of the golden-output test, which also runs without one.
"""

from __future__ import annotations

import json
import zlib

import pytest
import torch
from helpers import DATA, GPU, gpu_only

import prequant
from prequant.bnb import quantize as quantize_mod

VARIANTS = {
    "nf4_dq64": dict(quant_type="nf4", blocksize=64, double_quant=True),
    "nf4_64": dict(quant_type="nf4", blocksize=64, double_quant=False),
    "fp4_dq64": dict(quant_type="fp4", blocksize=64, double_quant=True),
    "nf4_dq128": dict(quant_type="nf4", blocksize=128, double_quant=True),
    "nf4_dq256": dict(quant_type="nf4", blocksize=256, double_quant=True),
}


def _golden():
    from safetensors import safe_open

    with safe_open(DATA / "golden.safetensors", "pt") as f:
        cases = json.loads(f.metadata()["cases"])
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    return cases, tensors


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=GPU), "cpu"])
def test_quantize_tensor_reproduces_golden_cuda_outputs(device):
    cases, tensors = _golden()
    for cv, state in cases.items():
        case, variant = cv.split("/")
        got = prequant.quantize_tensor(tensors[f"{case}/input"], device=device, **VARIANTS[variant])
        for name in ("weight", "absmax", "quant_map", "nested_absmax", "nested_quant_map"):
            if f"{cv}/{name}" in tensors:
                assert _same_bytes(got[name], tensors[f"{cv}/{name}"]), (device, cv, name)
        packed = {k: v for k, v in state.items() if k != "_packed_key"}
        assert json.loads(bytes(got[state["_packed_key"]].tolist())) == packed, (device, cv)


SHAPES = [(1, 3), (7, 129), (33, 4097), (11008,), (300, 64, 5), (2, 2**18 + 77)]
DISTRIBUTIONS = {
    "normal": lambda g, s: torch.randn(s, generator=g),
    "uniform": lambda g, s: torch.rand(s, generator=g) * 2 - 1,
    "heavy": lambda g, s: torch.randn(s, generator=g) ** 5,
    "sparse": lambda g, s: torch.randn(s, generator=g) * (torch.rand(s, generator=g) < 0.05),
    "tiny": lambda g, s: torch.randn(s, generator=g) * 1e-30,
    "grid": lambda g, s: torch.randint(-8, 9, s, generator=g) / 8.0,  # exact ties against the code tables
}


@gpu_only
@pytest.mark.parametrize("dist", list(DISTRIBUTIONS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cpu_kernel_equals_cuda_kernel_on_unseen_inputs(dist, dtype):
    g = torch.Generator().manual_seed(zlib.crc32(f"{dist}-{dtype}".encode()))
    for i, shape in enumerate(SHAPES):
        x = DISTRIBUTIONS[dist](g, shape).to(dtype)
        for quant_type in ("nf4", "fp4"):
            for blocksize in (64, 256, 4096) if i % 2 else (128, 512, 1024, 2048):
                opts = dict(quant_type=quant_type, blocksize=blocksize, double_quant=True)
                cpu, gpu = prequant.quantize_tensor(x, device="cpu", **opts), prequant.quantize_tensor(x, device="cuda", **opts)
                assert cpu.keys() == gpu.keys()
                for k in cpu:
                    assert _same_bytes(cpu[k], gpu[k]), (dist, dtype, shape, opts, k)


@gpu_only
def test_cpu_kernel_equals_cuda_kernel_on_a_real_layer():
    x = (torch.randn(14336, 4096, generator=torch.Generator().manual_seed(7)) * 0.02).to(torch.bfloat16)
    for opts in (dict(quant_type="nf4", double_quant=True), dict(quant_type="fp4", double_quant=False)):
        cpu, gpu = prequant.quantize_tensor(x, device="cpu", **opts), prequant.quantize_tensor(x, device="cuda", **opts)
        for k in cpu:
            assert _same_bytes(cpu[k], gpu[k]), (opts, k)


@gpu_only
def test_pieces_over_the_int32_limit_are_byte_identical_to_one_call(monkeypatch):
    x = torch.randn(3 * 2**20 + 4096, dtype=torch.bfloat16)
    whole = prequant.quantize_tensor(x, device="cuda")
    monkeypatch.setattr(quantize_mod, "MAX_KERNEL_ELEMENTS", 2**20 + 1000)  # forces 4 pieces
    pieces = prequant.quantize_tensor(x, device="cuda")
    for k in whole:
        assert _same_bytes(whole[k], pieces[k]), k


@gpu_only
@pytest.mark.slow
def test_tensor_over_2g_elements_matches_cpu_kernel():
    n = 2**31 + 3 * 2**20 + 64
    x = torch.randn(n, dtype=torch.bfloat16, device="cuda").cpu()
    gpu = prequant.quantize_tensor(x, device="cuda")
    cpu = prequant.quantize_tensor(x, device="cpu")
    for k in gpu:
        assert _same_bytes(gpu[k], cpu[k]), k


@gpu_only
@pytest.mark.parametrize("storage", [torch.bfloat16, torch.float16, torch.float32, torch.uint8])
@pytest.mark.parametrize("n", [3626, 3625, 3627, 3628, 1, 2, 7, 8, 37 * 99])
def test_lossy_storage_is_what_bitsandbytes_allocates(n, storage):
    """bnb.format.packed_length / loses_codes against bitsandbytes' own CUDA allocation."""
    import bitsandbytes.functional as F

    from prequant.bnb import format as fmt
    from prequant.checkpoint.dtypes import TORCH_TO_SAFETENSORS

    code = TORCH_TO_SAFETENSORS[storage]
    if fmt.packed_length(n, code) == 0:
        # bitsandbytes would allocate no storage at all and its kernel would write the codes to it anyway: an
        # illegal address, which poisons the CUDA context for every later test of the session (seen on the H200,
        # 2026-12-01). The formula is still checked: nothing stored, codes lost, and convert refuses such a tensor.
        assert fmt.loses_codes(n, code) and fmt.packed_bytes(n) > 0
        return
    packed, _ = F.quantize_4bit(torch.randn(n, device="cuda"), blocksize=64, quant_storage=storage)
    assert packed.numel() == fmt.packed_length(n, code)
    assert fmt.loses_codes(n, code) == (packed.numel() * storage.itemsize < fmt.packed_bytes(n))


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=GPU), "cpu"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("double_quant", [True, False])
def test_a_non_finite_value_is_refused_on_either_device(device, bad, double_quant):
    """On CUDA the check is read with the double quant's offset, after the kernels ran: still refused, by name."""
    x = torch.randn(64, 256)
    x[3, 17] = bad
    with pytest.raises(prequant.PrequantError, match="'blk.w' contains NaN or Inf"):
        quantize_mod.quantize_tensor(x, device=device, double_quant=double_quant, name="blk.w")


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=GPU), "cpu"])
def test_block_scales_whose_mean_overflows_are_refused_on_either_device(device):
    with pytest.raises(prequant.PrequantError, match="'blk.w': its block scales .* too large for double quant"):
        quantize_mod.quantize_tensor(torch.full((300, 64), 3e38), device=device, name="blk.w")
