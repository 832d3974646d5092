"""A uint8-stored output against what vLLM's bitsandbytes loader reads (vLLM needs a GPU: its rules are encoded here
from its source, and bitsandbytes' own QuantState.from_dict, which vLLM calls, runs on the CPU).

From vllm-project/vllm, vllm/model_executor/model_loader/bitsandbytes_loader.py (BitsAndBytesModelLoader) and
vllm/model_executor/layers/quantization/bitsandbytes.py (BitsAndBytesConfig, BitsAndBytesLinearMethod):
- config.json's quantization_config has quant_method "bitsandbytes" (pre-quantized), load_in_8bit false, and
  bnb_4bit_quant_storage "uint8": BitsAndBytesConfig raises ValueError for any other storage;
- `_is_4bit_weight_name`: a key whose last dot-separated part contains absmax, quant_map, nested_absmax,
  nested_quant_map or bitsandbytes is quant-state data, never a weight; every other key is a plain weight;
- a weight W is pre-quantized when `W.quant_state.bitsandbytes__nf4` (or `__fp4`) is among those keys, and its quant
  state is `QuantState.from_dict` of every such key containing `W + "."`;
- the layer's weight parameter is uint8 `[in * out // pack_factor, 1]` with pack_factor 2 for a bf16/fp16 model
  (create_qweight_for_4bit), so the packed tensor must be U8 `[numel / 2, 1]`, numel even.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from helpers import read_checkpoint

import prequant

_QUANT_SUFFIXES = ("absmax", "quant_map", "nested_absmax", "nested_quant_map", "bitsandbytes")


def _is_4bit_weight_name(key: str) -> bool:
    return any(s in key.split(".")[-1] for s in _QUANT_SUFFIXES)


@pytest.fixture(scope="module")
def uint8_output(checkpoints, tmp_path_factory):
    out = tmp_path_factory.mktemp("vllm") / "out"
    prequant.convert(checkpoints("llama"), out, device="cpu", progress=False, quant_storage="uint8",
                     max_shard_size="100KB")
    return out


def test_config_is_one_vllm_accepts(uint8_output):
    qc = json.loads((uint8_output / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "bitsandbytes" and qc["load_in_8bit"] is False and qc["load_in_4bit"] is True
    assert qc["bnb_4bit_quant_storage"] == "uint8"


def test_keys_and_quant_states_are_what_vllm_reads(uint8_output):
    from bitsandbytes.functional import QuantState

    tensors = read_checkpoint(uint8_output)
    state_dict = {k: v for k, v in tensors.items() if _is_4bit_weight_name(k)}
    weights = {k: v for k, v in tensors.items() if not _is_4bit_weight_name(k)}
    prequantized = [w for w in weights if f"{w}.quant_state.bitsandbytes__nf4" in state_dict]
    assert len(prequantized) == 14
    claimed = set()
    for w in prequantized:
        parts = {k: v for k, v in state_dict.items() if w + "." in k}
        claimed |= set(parts)
        state = QuantState.from_dict(parts, device="cpu")
        n = math.prod(state.shape)
        packed = weights[w]
        assert packed.dtype == torch.uint8 and n % 2 == 0 and tuple(packed.shape) == (n // 2, 1), w
        assert state.quant_type == "nf4" and state.nested and state.blocksize == 64
    assert claimed == set(state_dict)  # no quant-state key belongs to no weight (vLLM would misread it)
    kept = [w for w in weights if w not in prequantized]
    assert kept and all(weights[w].dtype == torch.bfloat16 for w in kept)
