"""bnb.quantize: the quantizer's device setup that can be checked without a GPU."""

from __future__ import annotations

import pytest
import torch

from prequant.bnb import quantize
from prequant.errors import UsageError


@pytest.mark.parametrize("value", ["8 parsecs", "GiB", "8XB"])
def test_a_malformed_cuda_memory_limit_is_a_usage_error(monkeypatch, value):
    """PREQUANT_CUDA_MEMORY_LIMIT must be a size (8GiB, 8000MB, bytes); anything else says so before CUDA starts."""
    monkeypatch.setenv(quantize.CUDA_MEMORY_LIMIT_ENV, value)
    with pytest.raises(UsageError, match="PREQUANT_CUDA_MEMORY_LIMIT"):
        quantize._limit_cuda_memory(torch.device("cuda", 0))
