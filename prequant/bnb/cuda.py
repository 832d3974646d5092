"""bitsandbytes' CUDA kernels, called as bitsandbytes' CUDA backend calls them, without torch's operator dispatch.

bitsandbytes registers each kernel as a torch custom operator, and the first call through that dispatch imports
torch._dynamo (torch.library wraps every custom operator's kernel so): some 800 modules, read from disk while a
conversion starts, behind its downloads and reads when the libraries are cold. A conversion needs four functions of
bitsandbytes' compiled library, so it calls them the way the backend does (`bitsandbytes.backends.cuda.ops`): the
same function, the same arguments, the same stream, hence the same bytes (tests/bnb/test_cuda.py compares each with
bitsandbytes' own call on the GPU).

ctypes knows each library function's argument types once bitsandbytes has set them. Where they are not the ones
these calls pass (another bitsandbytes release), every call here goes through bitsandbytes' functional API instead.
"""

from __future__ import annotations

import math
from functools import cache
from typing import Any

import torch

from . import importing

_DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
# (code, A, absmax, out, blocksize, n) for the quantizers; the dequantizers take the stream last.
_QUANTIZE_ARGS, _DEQUANTIZE_ARGS = 6, 7


@cache
def _library() -> Any | None:
    """bitsandbytes' compiled library when its kernels take the arguments this module passes, else None."""
    importing.functional()  # its import sets the functions' argument types
    from bitsandbytes.cextension import lib

    wanted = {"cquantize_blockwise_fp32": _QUANTIZE_ARGS, "cdequantize_blockwise_fp32": _DEQUANTIZE_ARGS}
    for dtype in _DTYPES.values():
        for quant_type in ("nf4", "fp4"):
            wanted[f"cquantize_blockwise_{dtype}_{quant_type}"] = _QUANTIZE_ARGS
            wanted[f"cdequantize_blockwise_{dtype}_{quant_type}"] = _DEQUANTIZE_ARGS
    for name, count in wanted.items():
        argtypes = getattr(getattr(lib, name, None), "argtypes", None)  # None: not a CUDA build, or not this release
        if argtypes is None or len(argtypes) != count:
            return None
    return lib


def code_4bit(quant_type: str, device: torch.device) -> torch.Tensor:
    """The 16 values of `quant_type`'s codes (the quant_map bitsandbytes stores), on `device`."""
    return importing.functional().get_4bit_type(quant_type, device=device)


def dynamic_code(device: torch.device) -> torch.Tensor:
    """The 256 values of the signed 8-bit dynamic map that double quantization codes block scales with."""
    return importing.functional().create_dynamic_map().to(device)


def quantize_4bit(x: torch.Tensor, blocksize: int, quant_type: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A flat contiguous CUDA tensor's packed 4-bit codes (uint8, two per byte) and float32 block scales."""
    lib = _library()
    if lib is None:
        packed, state = importing.functional().quantize_4bit(
            x, blocksize=blocksize, compress_statistics=False, quant_type=quant_type, quant_storage=torch.uint8
        )
        return packed.view(-1), state.absmax
    n = x.numel()
    absmax = torch.empty(math.ceil(n / blocksize), device=x.device, dtype=torch.float32)
    packed = torch.empty((n + 1) // 2, device=x.device, dtype=torch.uint8)
    with torch.cuda.device_of(x):
        getattr(lib, f"cquantize_blockwise_{_DTYPES[x.dtype]}_{quant_type}")(
            None, x.data_ptr(), absmax.data_ptr(), packed.data_ptr(), blocksize, n
        )
    return packed, absmax


def quantize_blockwise(x: torch.Tensor, code: torch.Tensor, blocksize: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A flat contiguous float32 CUDA tensor's 8-bit codes in `code` (uint8) and its float32 block scales."""
    lib = _library()
    if lib is None:
        codes, state = importing.functional().quantize_blockwise(x, code=code, blocksize=blocksize)
        return codes, state.absmax
    n = x.numel()
    absmax = torch.empty(math.ceil(n / blocksize), device=x.device, dtype=torch.float32)
    codes = torch.empty_like(x, dtype=torch.uint8)
    with torch.cuda.device_of(x):
        lib.cquantize_blockwise_fp32(code.data_ptr(), x.data_ptr(), absmax.data_ptr(), codes.data_ptr(), blocksize, n)
    return codes, absmax


def dequantize_blockwise(codes: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor,
                         blocksize: int) -> torch.Tensor:  # fmt: skip
    """8-bit codes (uint8, flat, contiguous, on CUDA) back to float32 through `code` and the block scales."""
    lib = _library()
    if lib is None:
        F = importing.functional()
        return F.dequantize_blockwise(codes, F.QuantState(absmax=absmax, code=code, blocksize=blocksize,
                                                          dtype=torch.float32))
    out = torch.empty_like(codes, dtype=torch.float32)
    with torch.cuda.device_of(codes):
        lib.cdequantize_blockwise_fp32(code.data_ptr(), codes.data_ptr(), absmax.data_ptr(), out.data_ptr(),
                                       blocksize, codes.numel(), torch.cuda.current_stream(codes.device).cuda_stream)
    return out


def dequantize_4bit(packed: torch.Tensor, absmax: torch.Tensor, blocksize: int, quant_type: str,
                    dtype: torch.dtype, n: int) -> torch.Tensor:  # fmt: skip
    """Packed 4-bit codes (uint8, flat, contiguous, on CUDA) back to `n` values of `dtype` with float32 block
    scales."""
    lib = _library()
    if lib is None:
        F = importing.functional()
        state = F.QuantState(absmax=absmax, shape=torch.Size([n]), dtype=dtype, blocksize=blocksize,
                             quant_type=quant_type)
        return F.dequantize_4bit(packed.view(-1, 1), state)
    out = torch.empty(n, device=packed.device, dtype=dtype)
    with torch.cuda.device_of(packed):
        getattr(lib, f"cdequantize_blockwise_{_DTYPES[dtype]}_{quant_type}")(
            None, packed.data_ptr(), absmax.data_ptr(), out.data_ptr(), blocksize, n,
            torch.cuda.current_stream(packed.device).cuda_stream,
        )
    return out
