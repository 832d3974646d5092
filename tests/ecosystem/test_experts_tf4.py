"""transformers 4.57 (the `.venv-tf4` consumer environment, or PREQUANT_TF4_PYTHON) loads `--quantize-experts`
outputs as they are, as the card says, with every expert a Linear4bit, and gives the logits `prequant.load_model`
gives on transformers 5.

bitsandbytes' CPU 4-bit matmul is wrong for these tiny shapes (in features not a multiple of 64, out not of 32), so
the 4.57 process multiplies by the weight dequantized as bitsandbytes' CUDA kernel does: what is compared is what
4.57 loaded (its modules, their packed weights and quant states), not bitsandbytes' CPU kernels. Without the
environment these tests skip, except under CI, where they fail."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch
from moe_checkpoints import HANDLED, build_moe

import prequant
from prequant.bnb.moe import require_transformers
from prequant.errors import PrequantError

ROOT = Path(__file__).resolve().parents[2]
IDS = ((torch.arange(0, 224, 7).view(2, -1) * 5) % 256).tolist()

_LOADER = r"""
import json, re, sys, torch
import bitsandbytes as bnb

out, code, ids = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])

def dequantized(weight):
    qs = weight.quant_state
    raw = weight.data.reshape(-1).view(torch.uint8).long()
    codes = torch.stack([raw >> 4, raw & 15], dim=1).reshape(-1)
    absmax = qs.absmax
    if qs.nested:
        scale = qs.state2.absmax.float().repeat_interleave(256)[: absmax.numel()]
        absmax = qs.state2.code.float()[absmax.long()] * scale + qs.offset
    n = qs.shape.numel()
    values = qs.code.float()[codes[:n]] * absmax.float().repeat_interleave(qs.blocksize)[:n]
    return values.to(qs.dtype).view(qs.shape)

def forward(self, x):
    compute = self.compute_dtype or x.dtype
    return torch.nn.functional.linear(x.to(compute), dequantized(self.weight).to(compute)).to(x.dtype)

bnb.nn.Linear4bit.forward = forward
scope = {}
exec(code.replace("device_map=\"auto\"", "device_map=\"cpu\""), scope)
model = scope["model"]
linear4 = [n for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)]
with torch.no_grad():
    logits = model(torch.tensor(ids)).logits.float()
print(json.dumps({"linear4bit": linear4, "logits": logits.tolist()}))
"""


def _snippet(out: Path) -> str:
    """The card's transformers 4.x snippet, naming the output folder."""
    text = (out / "README.md").read_text()
    code = re.search(r"```python\n(.*?)```", text[text.index("**transformers 4.x**"):], re.DOTALL).group(1)
    name = re.search(r'from_pretrained\("([^"]+)"', code).group(1)
    return code.replace(f'"{name}"', json.dumps(str(out)))


@pytest.mark.parametrize(("kind", "storage"), [*((k, "bfloat16") for k in HANDLED), ("mixtral", "uint8"),
                                               ("qwen2_moe", "uint8")])
@pytest.mark.slow
def test_transformers_4_57_loads_4bit_experts_with_load_model_s_logits(tf4, tmp_path, kind, storage):
    try:  # the reference logits come from load_model, which needs a recent transformers in this environment
        require_transformers()
    except PrequantError as e:
        pytest.skip(str(e))
    src = build_moe(kind, tmp_path / "src")
    out = tmp_path / "out"
    prequant.convert(src, out, device="cpu", progress=False, quantize_experts=True, quant_storage=storage)
    proc = subprocess.run([tf4, "-c", _LOADER, str(out), _snippet(out), json.dumps(IDS)], capture_output=True,
                          text=True, timeout=600, env={**os.environ, "PYTHONPATH": ""})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    quantized = {k.removesuffix(".weight.absmax") for k in _keys(out) if k.endswith(".weight.absmax")}
    assert set(result["linear4bit"]) == quantized and any(".experts.3." in k for k in quantized)
    with torch.no_grad():
        ours = prequant.load_model(out)(torch.tensor(IDS)).logits.float()
    theirs = torch.tensor(result["logits"])
    assert (ours - theirs).abs().max().item() <= 1e-2 * ours.abs().max().item(), kind


def _keys(out: Path) -> list[str]:
    from safetensors import safe_open

    keys = []
    for f in out.glob("*.safetensors"):
        with safe_open(f, "pt") as h:
            keys += list(h.keys())
    return keys
