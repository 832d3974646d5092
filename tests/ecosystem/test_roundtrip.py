"""Convert, load, verify: the short suite `.ci/run` also runs in `.venv-floor`, where every dependency is at the
lowest version pyproject.toml declares (`bash scripts/setup.sh floor`). Through the CLI, as users run it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import ROOT, build_grok, read_checkpoint, run_cli
from safetensors import safe_open

from prequant.verify.run import verify


def _dequantized_errors(model, src: Path, transposed: set[str]) -> dict[str, float]:
    """Each Linear4bit's weight, dequantized by bitsandbytes as loaded, against the source's."""
    import bitsandbytes as bnb
    from bitsandbytes.functional import dequantize_4bit

    source = read_checkpoint(src)
    errors = {}
    for name, module in model.named_modules():
        if isinstance(module, bnb.nn.Linear4bit) and f"{name}.weight" in source:
            w = dequantize_4bit(module.weight.data, module.weight.quant_state).float()
            ref = source[f"{name}.weight"].float()
            ref = ref.t() if f"{name}.weight" in transposed else ref
            errors[name] = ((w - ref).norm() / ref.norm()).item()
    return errors


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama", "gpt2", "mixtral"])
def test_converts_loads_and_verifies(kind, checkpoints, tmp_path):
    from transformers import AutoModelForCausalLM

    src, out = checkpoints(kind), tmp_path / "out"
    proc = run_cli("convert", str(src), str(out), "--device", "cpu", "--json")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    report = verify(out, src, progress=False)
    assert report.ok, report.to_text()
    model = AutoModelForCausalLM.from_pretrained(out, device_map="cpu")  # the card's transformers 5 call
    transposed = set(json.loads((out / "prequant.json").read_text())["transposed"])
    errors = _dequantized_errors(model, src, transposed)
    assert len(errors) == summary["tensors_quantized"] and max(errors.values()) < 0.12, errors
    ids = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()


def test_grok_bin_shards_with_remote_code_convert_load_and_verify(tmp_path):
    from transformers import AutoModelForCausalLM

    src, out = build_grok(tmp_path / "grok-1-hf", "keyfan", shards=2), tmp_path / "out"
    proc = run_cli("convert", str(src), str(out), "--device", "cpu", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["tensors_quantized"] == 2 * (4 + 4 * 3)  # attention and experts, per layer
    assert verify(out, src, progress=False).ok
    import bitsandbytes as bnb

    model = AutoModelForCausalLM.from_pretrained(out, device_map="cpu", trust_remote_code=True)
    assert sum(isinstance(m, bnb.nn.Linear4bit) for m in model.modules()) == 32


def test_storage_round_trip_verifies(checkpoints, tmp_path):
    src = checkpoints("llama")
    for args in (("convert", str(src), str(tmp_path / "bf16"), "--device", "cpu"),
                 ("change-storage", str(tmp_path / "bf16"), str(tmp_path / "u8"), "--quant-storage", "uint8"),
                 ("change-storage", str(tmp_path / "u8"), str(tmp_path / "back"), "--quant-storage", "bfloat16")):
        proc = run_cli(*args)
        assert proc.returncode == 0, proc.stderr
    for name in ("model.safetensors", "config.json", "README.md", "prequant.json"):
        assert (tmp_path / "back" / name).read_bytes() == (tmp_path / "bf16" / name).read_bytes(), name
    with safe_open(tmp_path / "u8" / "model.safetensors", "pt") as f:
        assert f.get_slice("model.layers.0.mlp.down_proj.weight").get_dtype() == "U8"
    assert verify(tmp_path / "u8", src, progress=False).ok


@pytest.mark.slow
def test_fsdp_qlora_steps_on_two_ranks(checkpoints, tmp_path):
    """load_for_fsdp (peft, torch.distributed with gloo) on the converted checkpoint: packed bytes intact."""
    src, out = checkpoints("llama"), tmp_path / "out"
    assert run_cli("convert", str(src), str(out), "--device", "cpu").returncode == 0
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench" / "check_fsdp.py"), str(out), "--nproc", "2",
                           "--loader", "prequant", "--steps", "2", "--seq-len", "16", "--batch-size", "1", "--lora-r",
                           "4", "--json"], capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout)["ok"] is True
