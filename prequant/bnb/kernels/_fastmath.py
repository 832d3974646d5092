"""float32 arithmetic as bitsandbytes' CUDA kernels do it: built with ``--use_fast_math``.

Fast math changes two things that reach the output bytes:

* flush-to-zero: every float operation (``abs``, ``max``, ``mul``, compares) treats a denormal operand as
  a zero of the same sign and flushes a denormal result to zero;
* ``1.0f / absmax`` is not a division but ``rcp.approx.ftz.f32`` (SASS ``MUFU.RCP``), which is one of the
  two float32 neighbours of the exact reciprocal, not always the nearest (see `_mufu_rcp_table`).
"""

from __future__ import annotations

import base64
import functools
import hashlib
import zlib

import numpy as np
import torch

FLT_MIN = 2.0**-126  # smallest normal float32
_LARGEST_DENORMAL = float(torch.tensor(0x007FFFFF, dtype=torch.int32).view(torch.float32))
_MANTISSA_MASK = 0x007FFFFF
# Inputs at or above 2**126 have a reciprocal below FLT_MIN: MUFU.RCP flushes it to 0, except for 2**126
# itself, whose reciprocal 2**-126 is still normal (measured on the GPU).
_RCP_FLUSH_ABOVE = 2.0**126


def mul_ftz_flushes(exact: torch.Tensor) -> torch.Tensor:
    """Whether ``mul.ftz.f32`` returns zero for a product whose exact value (float64) is ``exact``.

    Measured on the GPU: it rounds to 24 significant bits as if the exponent were unbounded and flushes
    when that is below FLT_MIN, i.e. when |exact| < FLT_MIN * (1 - 2**-25) (the tie rounds up to FLT_MIN).
    IEEE rounding onto the denormal grid instead rounds up from FLT_MIN * (1 - 2**-24).
    """
    return exact.abs() < FLT_MIN * (1.0 - 2.0**-25)


def flush_denormals_(x: torch.Tensor) -> torch.Tensor:
    """Replace denormal float32 values by zero, in place (what an ``.ftz`` instruction sees).

    ``hardshrink`` keeps exactly the values whose magnitude exceeds the largest denormal, in one pass.
    The sign of a flushed value is irrelevant downstream: every use multiplies or compares it.
    """
    return torch.hardshrink(x, _LARGEST_DENORMAL, out=x)


@functools.cache
def _rcp_flip_bits() -> np.ndarray:
    """uint8 [2**20]: bit (m & 7) of byte (m >> 3) is 1 where MUFU.RCP takes the farther neighbour of
    the exact reciprocal of a mantissa m (1 MiB resident instead of a byte per mantissa)."""
    from . import _mufu_rcp_table as table

    raw = zlib.decompress(base64.b64decode(table.FLIPS_ZLIB_B64))
    if hashlib.sha256(raw).hexdigest() != table.FLIPS_SHA256:
        raise RuntimeError("prequant/kernels/_mufu_rcp_table.py is corrupt (hash mismatch); reinstall prequant")
    return np.packbits(np.frombuffer(raw, dtype=np.uint8), bitorder="little")


def rcp_approx_ftz(a: torch.Tensor) -> torch.Tensor:
    """``rcp.approx.ftz.f32`` of a non-negative float32 tensor (on the CPU), bit for bit as a Hopper GPU
    computes it; see `rcp_approx_ftz_array`."""
    values = np.ascontiguousarray(a.detach().to(torch.float32).numpy())
    return torch.from_numpy(rcp_approx_ftz_array(values))


def rcp_approx_ftz_array(a: np.ndarray) -> np.ndarray:
    """``rcp.approx.ftz.f32`` of a contiguous non-negative float32 array, bit for bit as a Hopper GPU does it.

    Zero (and denormal, flushed) inputs give +inf; inputs above 2**126 give 0 (the denormal result is
    flushed). Otherwise the GPU returns one of the two float32 values around 1/a: start from the correctly
    rounded one and, where the measured table says so, step one ulp to the other side of 1/a. numpy, not
    torch: the kernel calls this on a few thousand values per task, where per-operation overhead dominates.
    """
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):  # 0 and denormals: fixed below
        wide = a.astype(np.float64)
        nearest = np.divide(1.0, wide).astype(np.float32)  # correctly rounded: float64 has > 2 * 24 + 2 bits
        # Which side of 1/a is `nearest` on? The product of two float32 values is exact in float64.
        below = nearest.astype(np.float64) * wide < 1.0
    mantissa = a.view(np.uint32) & _MANTISSA_MASK
    flip = (_rcp_flip_bits()[mantissa >> 3] >> (mantissa & 7).astype(np.uint8)) & 1
    step = np.where(below, flip.astype(np.int32), -flip.astype(np.int32))
    out = (nearest.view(np.int32) + step).view(np.float32)
    out[a < FLT_MIN] = np.inf
    out[a > _RCP_FLUSH_ABOVE] = 0.0
    return out
