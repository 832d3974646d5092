"""bnb.cuda (run with `-m gpu`): each of bitsandbytes' CUDA kernels called directly gives the bytes of bitsandbytes'
own call of it, for every dtype, quant type and block size prequant uses, odd lengths and partial blocks included;
so does the functional path used where the library's functions take other arguments."""

from __future__ import annotations

import pytest
import torch
from helpers import GPU

from prequant.bnb import cuda, importing

pytestmark = GPU

LENGTHS = [1, 63, 64, 4097, 2**18 + 77]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.numel() == b.numel() and torch.equal(
        a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _values(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g) ** 3).to(dtype).cuda()


@pytest.fixture(params=["direct", "functional"])
def path(request, monkeypatch):
    """Both ways bnb.cuda calls a kernel: the library's function itself, or bitsandbytes' functional API."""
    if request.param == "functional":
        monkeypatch.setattr(cuda, "_library", lambda: None)
    else:
        assert cuda._library() is not None, "bitsandbytes' library takes other arguments than bnb.cuda passes"
    return request.param


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("blocksize", [64, 128, 256, 4096])
def test_4bit_quantize_and_dequantize_are_bitsandbytes_own(path, dtype, quant_type, blocksize):
    F = importing.functional()
    for seed, n in enumerate(LENGTHS):
        x = _values(n, dtype, seed)
        packed, absmax = cuda.quantize_4bit(x, blocksize, quant_type)
        want, state = F.quantize_4bit(x, blocksize=blocksize, compress_statistics=False, quant_type=quant_type,
                                      quant_storage=torch.uint8)
        assert _same(packed, want) and _same(absmax, state.absmax), (n, "quantize")
        assert _same(cuda.code_4bit(quant_type, x.device), state.code)
        back = cuda.dequantize_4bit(packed, absmax, blocksize, quant_type, dtype, n)
        assert _same(back, F.dequantize_4bit(want, state)), (n, "dequantize")


def test_blockwise_8bit_quantize_and_dequantize_are_bitsandbytes_own(path):
    F = importing.functional()
    code = cuda.dynamic_code(torch.device("cuda"))
    for seed, n in enumerate(LENGTHS):
        x = _values(n, torch.float32, seed)
        codes, absmax = cuda.quantize_blockwise(x, code, 256)
        want, state = F.quantize_blockwise(x, blocksize=256)
        assert _same(codes, want) and _same(absmax, state.absmax) and _same(code, state.code), (n, "quantize")
        assert _same(cuda.dequantize_blockwise(codes, absmax, code, 256), F.dequantize_blockwise(want, state)), n
