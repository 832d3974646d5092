"""bnb.loading: what transformers does with each tensor as it loads it (dtype, skip-list matching), checked against
transformers itself where it runs here, and the --skip patterns transformers 4.x would not match, flagged."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import run_cli

from prequant.bnb import loading
from prequant.checkpoint.reader import scan_files


@pytest.mark.parametrize("stored", ["dtype", "torch_dtype", None], ids=["dtype", "legacy-torch_dtype", "absent"])
def test_load_dtype_is_the_one_from_pretrained_uses(checkpoints, tmp_path, stored):
    from transformers import AutoModelForCausalLM

    src = Path(shutil.copytree(checkpoints("llama"), tmp_path / "src"))
    config = json.loads((src / "config.json").read_text())
    config.pop("dtype", None)
    config.pop("torch_dtype", None)
    if stored is not None:
        config[stored] = "float16"  # not the checkpoint's bf16: the config decides
    (src / "config.json").write_text(json.dumps(config))
    model = AutoModelForCausalLM.from_pretrained(src, device_map="cpu")
    expected = {torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32"}[model.dtype]
    assert loading.load_dtype(config, scan_files([src / "model.safetensors"])) == expected
    assert expected == ("F16" if stored else "BF16")


@pytest.mark.slow
@pytest.mark.parametrize("pattern", ["(", "*.down_proj", "[", "", "  "])
def test_skip_patterns_transformers_cannot_compile_are_refused(checkpoints, tmp_path, pattern):
    proc = run_cli("convert", str(checkpoints("llama")), str(tmp_path / "out"), "--skip", pattern, "--dry-run")
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"Error: --skip {pattern!r} is "), proc.stderr


def test_dotted_suffix_is_flagged_for_transformers_4(checkpoints, tmp_path):
    """transformers 5 matches "mlp.down_proj" as a suffix, 4.x only by module name or path prefix."""
    proc = run_cli("convert", str(checkpoints("llama")), str(tmp_path / "out"), "--device", "cpu",
                   "--skip", "mlp.down_proj")
    assert proc.returncode == 0, proc.stderr
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("prequant: warning:")]
    assert warnings == [
        "prequant: warning: --skip 'mlp.down_proj': transformers 4.x matches llm_int8_skip_modules only by module "
        "name or module path prefix, so it would load model.layers.0.mlp.down_proj and 1 more as 4-bit and fail; "
        "to load with transformers 4.x as well, pass the module name (down_proj) or full path instead"
    ]
    plan = json.loads(run_cli("convert", str(checkpoints("llama")), str(tmp_path / "x"), "--skip", "mlp.down_proj",
                              "--dry-run", "--json").stdout)
    assert plan["warnings"] == [warnings[0].removeprefix("prequant: warning: ")]


@pytest.mark.parametrize("pattern", ["down_proj", "model.layers.0", "model.layers.1.mlp.down_proj"])
def test_patterns_transformers_4_matches_are_not_flagged(checkpoints, tmp_path, pattern):
    proc = run_cli("convert", str(checkpoints("llama")), str(tmp_path / "out"), "--skip", pattern, "--dry-run",
                   "--json")
    assert proc.returncode == 0, proc.stderr
    assert "warnings" not in json.loads(proc.stdout)
