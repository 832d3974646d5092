"""Loading prequant's outputs as the card says in a consumer's environment: transformers 4.57, the last 4.x, in
`.venv-tf4` (`bash scripts/setup.sh tf4`; it needs huggingface_hub < 1.0, so prequant is not installed there).

`.ci/run` builds `.venv-tf4`; without it (or PREQUANT_TF4_PYTHON) these tests skip, except under CI, where they fail."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

import prequant


# Run in the transformers 4.57 environment: load the checkpoint with the code given (the card's snippet, which
# defines `model`), then each Linear4bit's weight dequantized by bitsandbytes against the source's.
_LOADER = r"""
import json, sys, torch
import bitsandbytes as bnb
from bitsandbytes.functional import dequantize_4bit
from safetensors.torch import load_file
from pathlib import Path

out, src, code = sys.argv[1], sys.argv[2], sys.argv[3]
scope = {}
try:
    exec(code, scope)
except Exception as e:
    print(json.dumps({"error": f"{type(e).__name__}: {e}"[:500]}))
    sys.exit()
model = scope["model"]
source = {}
for f in sorted(Path(src).glob("*.safetensors")):
    source.update(load_file(f))
errors, packed = {}, None
for name, m in model.named_modules():
    if isinstance(m, bnb.nn.Linear4bit):
        w = dequantize_4bit(m.weight.data, m.weight.quant_state).float()
        ref = source[name + ".weight"].float()
        errors[name] = ((w - ref).norm() / ref.norm()).item()
        packed = str(m.weight.dtype)
print(json.dumps({"errors": errors, "packed": packed}))
"""


@pytest.fixture(scope="module")
def outputs(checkpoints, tmp_path_factory):
    """(kind, storage) -> (source, output): tiny Llama and Mixtral, bf16 and uint8 storage."""
    made = {}
    root = tmp_path_factory.mktemp("consumers")
    for kind in ("llama", "mixtral"):
        for storage in ("bfloat16", "uint8"):
            out = root / f"{kind}-{storage}"
            prequant.convert(checkpoints(kind), out, device="cpu", progress=False, quant_storage=storage)
            made[kind, storage] = (checkpoints(kind), out)
    return made


def card_snippet(out: Path, heading: str) -> str:
    """The Python snippet that follows `heading` in the output's card, naming the output folder."""
    text = (out / "README.md").read_text()
    after = text[text.index(heading):]
    code = re.search(r"```python\n(.*?)```", after, re.DOTALL).group(1)
    name = re.search(r'from_pretrained\("([^"]+)"', code).group(1)
    return code.replace(f'"{name}"', json.dumps(str(out)))


def load_in_tf4(python: str, out: Path, src: Path, code: str) -> dict:
    proc = subprocess.run([python, "-c", _LOADER, str(out), str(src), code], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PYTHONPATH": ""})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _plain_load(out: Path) -> str:
    return ("from transformers import AutoModelForCausalLM\n"
            f"model = AutoModelForCausalLM.from_pretrained({json.dumps(str(out))}, device_map='cpu')\n")


@pytest.mark.slow
@pytest.mark.parametrize("storage", ["bfloat16", "uint8"])
def test_transformers_4_57_loads_it_correctly_as_the_card_says(tf4, outputs, storage):
    src, out = outputs["llama", storage]
    code = card_snippet(out, "**transformers 4.x**")
    assert "dtype=torch." in code and "torch_dtype" not in code
    result = load_in_tf4(tf4, out, src, code)
    assert len(result["errors"]) == 14 and max(result["errors"].values()) < 0.12, result


@pytest.mark.slow
def test_transformers_4_57_without_dtype_casts_bf16_packed_weights_as_numbers(tf4, outputs):
    """Why the card passes dtype: 4.57 loads bitsandbytes models in float16 when none is given, and converts the
    bfloat16-stored codes to float16 as numbers."""
    src, out = outputs["llama", "bfloat16"]
    result = load_in_tf4(tf4, out, src, _plain_load(out))
    assert result["packed"] == "torch.float16" and min(result["errors"].values()) > 1.0, result


@pytest.mark.slow
def test_transformers_4_57_never_casts_uint8_packed_weights(tf4, outputs):
    src, out = outputs["llama", "uint8"]
    result = load_in_tf4(tf4, out, src, _plain_load(out))
    assert result["packed"] == "torch.uint8" and max(result["errors"].values()) < 0.12, result


def test_fused_moe_card_says_transformers_5_only_and_4_57_cannot_load_it(tf4, outputs):
    src, out = outputs["mixtral", "bfloat16"]
    text = (out / "README.md").read_text()
    assert "loads in transformers 5 only" in text and "**transformers 4.x**" not in text and "vllm" not in text
    assert "error" in load_in_tf4(tf4, out, src, card_snippet(out, "**FSDP+QLoRA**"))  # its experts: no 4-bit data
