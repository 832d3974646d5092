"""bnb.format, the one definition of the 4-bit checkpoint format, pinned to what bitsandbytes' CUDA kernel wrote
(the golden file) and to what transformers saves (a tiny model quantized on load, then save_pretrained)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors import safe_open

from helpers import DATA, read_checkpoint, transformers_reference
from prequant.bnb import format as fmt
from prequant.checkpoint.dtypes import TORCH_TO_SAFETENSORS

GOLDEN = DATA / "golden.safetensors"
VARIANTS = {"nf4_dq64": ("nf4", 64, True), "nf4_64": ("nf4", 64, False), "fp4_dq64": ("fp4", 64, True),
            "nf4_dq128": ("nf4", 128, True), "nf4_dq256": ("nf4", 256, True)}


def golden_cases():
    with safe_open(GOLDEN, "pt") as f:
        return json.loads(f.metadata()["cases"])


@pytest.mark.parametrize("case", sorted(golden_cases()))
def test_entries_are_the_golden_keys_dtypes_and_shapes(case):
    """Every companion bitsandbytes' kernel produced, with its dtype and shape, and nothing else (U8 storage)."""
    name, variant = case.split("/")
    quant_type, blocksize, nested = VARIANTS[variant]
    state = golden_cases()[case]
    with safe_open(GOLDEN, "pt") as f:
        n = math.prod(f.get_slice(f"{name}/input").get_shape())
        got = {k.removeprefix(f"{case}/"): (f.get_slice(k).get_dtype(), tuple(f.get_slice(k).get_shape()))
               for k in f.keys() if k.startswith(f"{case}/") and not k.endswith("/dequant")}
    layout = fmt.entries("W", n, quant_type=quant_type, blocksize=blocksize, double_quant=nested, storage_code="U8")
    expected = {fmt.entry_name("W", e.key): (e.dtype, e.shape) for e in layout if e.shape is not None}
    # bitsandbytes' own U8 sizing is ceil(n / 2); the format's packed_length agrees for U8 storage
    assert got == expected
    assert fmt.packed_length(n, "U8") == fmt.packed_bytes(n)
    # the quant state: the state key, the keys in bitsandbytes' order, and a state verify accepts
    assert fmt.state_key("W", quant_type) == f"W.{state['_packed_key']}"
    decoded = {k: v for k, v in state.items() if k != "_packed_key"}
    rebuilt = fmt.quant_state(quant_type, blocksize, decoded["dtype"], decoded["shape"],
                              decoded.get("nested_offset") if nested else None)
    assert list(rebuilt.items()) == list(decoded.items())
    assert fmt.quant_state_problems(rebuilt, quant_type) == []
    assert fmt.is_nested(rebuilt) is nested


SETTINGS = [
    dict(bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, bnb_4bit_quant_storage=torch.bfloat16),
    dict(bnb_4bit_quant_type="fp4", bnb_4bit_use_double_quant=False, bnb_4bit_quant_storage=torch.uint8),
    dict(bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, bnb_4bit_quant_storage=torch.float32),
]


@pytest.mark.parametrize("overrides", SETTINGS, ids=["nf4-dq-bf16", "fp4-uint8", "nf4-dq-fp32"])
def test_entries_and_quant_states_are_what_transformers_saves(checkpoints, tmp_path, overrides):
    src = checkpoints("llama")
    saved = read_checkpoint(transformers_reference(src, tmp_path / "ref", **overrides))
    original = read_checkpoint(src)
    quant_type = overrides["bnb_4bit_quant_type"]
    storage = TORCH_TO_SAFETENSORS[overrides["bnb_4bit_quant_storage"]]
    states = {w: k for k in saved if (w := (fmt.split_state_key(k) or (None,))[0])}
    assert states, "transformers quantized nothing"
    claimed = set()
    for weight, key in states.items():
        raw = bytes(saved[key].tolist())
        state = fmt.decode_quant_state(raw)
        assert fmt.quant_state_problems(state, quant_type) == [], weight
        # the JSON text, byte for byte: what the quantizer writes is what bitsandbytes packs
        assert fmt.encode_quant_state(fmt.quant_state(
            state["quant_type"], state["blocksize"], state["dtype"], state["shape"], state.get("nested_offset"))) == raw
        layout = fmt.entries(weight, original[weight].numel(), quant_type=quant_type, blocksize=state["blocksize"],
                             double_quant=overrides["bnb_4bit_use_double_quant"], storage_code=storage)
        for e in layout:
            t = saved[e.key]
            assert TORCH_TO_SAFETENSORS[t.dtype] == e.dtype, e.key
            if e.shape is not None:
                assert tuple(t.shape) == e.shape, e.key
            claimed.add(e.key)
    # nothing under a 4-bit weight that the format does not name
    under = {k for k in saved for w in states if k.startswith(w + ".")}
    assert under <= claimed


def test_quantization_config_is_the_one_transformers_writes(checkpoints, tmp_path):
    src = checkpoints("llama")
    ref = transformers_reference(src, tmp_path / "ref")
    written = json.loads((ref / "config.json").read_text())["quantization_config"]
    settings = fmt.Settings(quant_type="nf4", double_quant=True, blocksize=64, compute_dtype="bfloat16",
                            quant_storage="bfloat16")
    assert fmt.quantization_config(settings, written["llm_int8_skip_modules"]) == written


def test_packed_length_follows_bitsandbytes_sizing_for_wide_storage():
    # (n + 1) // (2 * itemsize): 37 x 98 = 3626 codes need 1813 bytes; bf16 storage holds 906 words = 1812 bytes
    assert fmt.packed_bytes(37 * 98) == 1813
    assert fmt.packed_length(37 * 98, "BF16") == 906
    assert fmt.packed_length(37 * 98, "U8") == 1813
    assert fmt.packed_length(4096 * 4096, "F32") == 4096 * 4096 // 8


def test_entry_names_round_trip():
    w = "model.layers.0.mlp.down_proj.weight"
    for entry in ("weight", *fmt.COMPANIONS, fmt.STATE_PREFIX + "nf4"):
        assert fmt.entry_name(w, fmt.entry_key(w, entry)) == entry
    assert fmt.split_state_key(fmt.state_key(w, "fp4")) == (w, "fp4")
    assert fmt.split_state_key(w + ".absmax") is None


@pytest.mark.parametrize("state, problem", [
    ({"quant_type": "nf4", "blocksize": 64, "dtype": "bfloat16"}, "lacks shape"),
    ({"quant_type": "fp4", "blocksize": 64, "dtype": "bfloat16", "shape": [2, 2]}, "does not match the key's __nf4"),
    ({"quant_type": "nf4", "blocksize": 65, "dtype": "bfloat16", "shape": [2, 2]}, "blocksize 65"),
    ({"quant_type": "nf4", "blocksize": 64, "dtype": "int8", "shape": [2, 2]}, "dtype 'int8'"),
    ({"quant_type": "nf4", "blocksize": 64, "dtype": "bfloat16", "shape": [0]}, "not a list of positive integers"),
    ({"quant_type": "nf4", "blocksize": 64, "dtype": "bfloat16", "shape": [2], "extra": 1}, "has unexpected extra"),
    ({"quant_type": "nf4", "blocksize": 64, "dtype": "bfloat16", "shape": [2], "nested_blocksize": 128,
      "nested_dtype": "float32", "nested_offset": 0.1}, "nested_blocksize 128"),
    ({"quant_type": "nf4", "blocksize": 64, "dtype": "bfloat16", "shape": [2], "nested_blocksize": 256,
      "nested_dtype": "float32", "nested_offset": float("nan")}, "nested_offset nan"),
    ([1, 2], "not a JSON object"),
])
def test_quant_state_problems_name_what_is_wrong(state, problem):
    problems = fmt.quant_state_problems(state, "nf4")
    assert any(problem in p for p in problems), problems


@pytest.mark.parametrize(
    "n,storage,loses",
    [(37 * 98, "BF16", True), (37 * 98, "U8", False), (3627, "BF16", False), (3628, "BF16", False),
     (3625, "BF16", True), (4096 * 14336, "BF16", False), (8 * 11 + 3, "F32", True), (8 * 11 + 7, "F32", False),
     (8 * 11 + 1, "F16", True)],
)
def test_storage_that_loses_codes(n, storage, loses):
    """bitsandbytes stores (n + 1) // (2 * itemsize) words: 37 x 98 in bf16 is 906 words, 1,812 of 1,813 bytes."""
    assert fmt.loses_codes(n, storage) is loses
    if (n, storage) == (37 * 98, "BF16"):
        assert fmt.packed_length(n, storage) * 2 == 1812 and fmt.packed_bytes(n) == 1813


def test_the_torch_free_itemsize_table_agrees_with_torch():
    from prequant.checkpoint.codes import ITEMSIZE
    from prequant.checkpoint.dtypes import SAFETENSORS_DTYPES

    assert {code: dtype.itemsize for code, dtype in SAFETENSORS_DTYPES.items()} == ITEMSIZE
