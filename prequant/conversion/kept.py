"""The values of the tensors kept unquantized (embeddings, norms, biases, masks): a NaN is refused unless
--allow-nan, NaN and Inf are counted for prequant.json and the summary.

A NaN in a kept tensor is damage: it poisons every forward that touches it. An Inf is not, always: attention
masks and some biases use it on purpose, so it is recorded and reported, not refused. The check is one
reduction (`aminmax`, which propagates NaN) over the bytes the conversion reads anyway: the mapped view whose
pages the kernel then copies (copy_file_range), or the tensor just cast on the quantizing device. Only a tensor
that fails it is counted precisely, in bounded chunks.
"""

from __future__ import annotations

import threading

import torch

from ..errors import PrequantError

CHECKED = (torch.float16, torch.bfloat16, torch.float32, torch.float64)  # float8 has no Inf (e4m3) or no use for it
_COUNT_CHUNK = 1 << 24


def non_finite(t: torch.Tensor) -> tuple[int, int]:
    """(NaN count, Inf count) of a tensor; (0, 0) for integer, bool and float8 tensors."""
    if t.dtype not in CHECKED or t.numel() == 0:
        return 0, 0
    lo, hi = torch.aminmax(t)
    if bool(torch.isfinite(lo)) and bool(torch.isfinite(hi)):
        return 0, 0
    flat, nan, inf = t.reshape(-1), 0, 0
    for start in range(0, flat.numel(), _COUNT_CHUNK):
        part = flat[start : start + _COUNT_CHUNK]
        nan += int(torch.isnan(part).sum())
        inf += int(torch.isinf(part).sum())
    return nan, inf


class KeptCheck:
    """Checks each kept tensor (called from the pipeline's threads) and keeps what it found, by source name."""

    def __init__(self, allow_nan: bool) -> None:
        self.allow_nan = allow_nan
        self.found: dict[str, tuple[int, int]] = {}  # name -> (NaN, Inf), only tensors with any
        self._lock = threading.Lock()

    def __call__(self, name: str, tensor: torch.Tensor) -> tuple[int, int] | None:
        """Refuse a NaN (PrequantError naming the tensor) unless allowed; return the counts when not all finite."""
        nan, inf = non_finite(tensor)
        if not (nan or inf):
            return None
        if nan and not self.allow_nan:
            also = f" (and {inf:,} Inf)" if inf else ""
            raise PrequantError(
                f"tensor {name!r}, kept unquantized, holds {nan:,} NaN values{also}, which poison every forward "
                "through it; fix the source checkpoint, or pass --allow-nan to copy it as it is (recorded in "
                "prequant.json)"
            )
        with self._lock:
            self.found[name] = (nan, inf)
        return nan, inf

    def record(self) -> dict[str, dict[str, int]]:
        """prequant.json's "non_finite" table."""
        return {name: {"nan": nan, "inf": inf} for name, (nan, inf) in sorted(self.found.items())}
