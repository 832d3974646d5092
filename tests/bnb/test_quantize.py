"""bnb.quantize: the quantizer's device setup that can be checked without a GPU."""

from __future__ import annotations

import pytest
import torch

from prequant import settings
from prequant.bnb import quantize
from prequant.errors import UsageError

from helpers import gpu_only


@pytest.mark.parametrize("value", ["8 parsecs", "GiB", "8XB"])
def test_a_malformed_cuda_memory_limit_is_a_usage_error(monkeypatch, value):
    """PREQUANT_CUDA_MEMORY_LIMIT must be a size (8GiB, 8000MB, bytes); anything else says so before CUDA starts."""
    monkeypatch.setenv(settings.CUDA_MEMORY_LIMIT, value)
    with pytest.raises(UsageError, match="PREQUANT_CUDA_MEMORY_LIMIT"):
        quantize._limit_cuda_memory(torch.device("cuda", 0))


def test_auto_weighs_the_checkpoint_before_it_asks_cuda(monkeypatch):
    """Below AUTO_CUDA_FROM `auto` is the CPU without CUDA being asked (its start-up is what it saves); from it on,
    CUDA decides, as it does with no size given."""
    asked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: asked.append(True) or False)
    assert quantize.pick_device("auto", quantize.AUTO_CUDA_FROM - 1) == torch.device("cpu")
    assert asked == []
    assert quantize.pick_device("auto", quantize.AUTO_CUDA_FROM) == torch.device("cpu") and asked == [True]
    assert quantize.pick_device("auto") == torch.device("cpu") and len(asked) == 2
    assert quantize.pick_device("cpu", 10**15) == torch.device("cpu")


@gpu_only
def test_auto_takes_the_gpu_for_large_weights_and_cuda_is_always_cuda():
    assert quantize.pick_device("auto", quantize.AUTO_CUDA_FROM).type == "cuda"
    assert quantize.pick_device("auto", 1).type == "cpu"
    assert quantize.pick_device("cuda", 1).type == "cuda"
