"""A conversion plans on transformers' layout: taken from names alone where that is settled (transformers'
modeling code never imported), asked of transformers before planning otherwise."""

import json
import shutil
import subprocess
import sys

import pytest

from prequant.bnb.layout import analyze
from prequant.bnb.predict import verified
from prequant.checkpoint import hf_files
from prequant.conversion.options import ConvertOptions
from prequant.conversion.plan import make_plan
from prequant.source import resolve as sources

from helpers import cli_env, run_cli

# On a transformers outside predict.VERIFIED nothing settles: raise it after scripts/dev/check_layout_rules.py
# passes with that version.
SETTLES_HERE = pytest.mark.skipif(not verified(), reason="the installed transformers is outside predict.VERIFIED")
MODELING = ("transformers.modeling_utils", "transformers.models.llama.modeling_llama",
            "transformers.models.gpt2.modeling_gpt2")


def _one_layer_config(checkpoints, tmp_path):
    """config.json says 1 layer where the files hold 2: transformers' model has no layer 1, so it keeps layer 1's
    projections unquantized (not linear weights of its model), while the names alone say nn.Linear."""
    src = shutil.copytree(checkpoints("llama"), tmp_path / "src")
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1}))
    return src


def test_an_unsettled_checkpoint_is_converted_on_transformers_layout(checkpoints, tmp_path):
    src = _one_layer_config(checkpoints, tmp_path)
    proc = run_cli("convert", str(src), str(tmp_path / "out"), "--device", "cpu", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["tensors_quantized"] == 7, "only layer 0's seven projections, as transformers"


def _convert_in_child(src, out, *args):
    """convert() in a fresh interpreter; its result and which of transformers' modeling modules it imported."""
    code = ("import json, sys, prequant\n"
            f"r = prequant.convert({str(src)!r}, {str(out)!r}, device='cpu'{''.join(', ' + a for a in args)})\n"
            f"print(json.dumps([r.to_dict(), [m for m in {MODELING!r} if m in sys.modules]]))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=cli_env(), check=False)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


def _transformers_plan(src_dir) -> dict:
    src = sources.resolve(str(src_dir))
    tensors = sources.scan(src)
    layout = analyze(hf_files.read_config(src.path), src.path, tensors, [], False)
    options = ConvertOptions()
    return make_plan(tensors, layout, options.settings, options.shard_limit).to_dict()


@pytest.mark.slow
@SETTLES_HERE
def test_a_settled_conversion_plans_as_transformers_without_its_modeling_code(checkpoints, tmp_path):
    for kind in ("llama", "gpt2"):
        src = checkpoints(kind)
        plan, imported = _convert_in_child(src, tmp_path / f"{kind}-plan", "dry_run=True")
        assert imported == [] and plan == _transformers_plan(src)
        summary, imported = _convert_in_child(src, tmp_path / kind)
        assert imported == [], f"{kind}: a settled conversion imported {imported}"
        assert summary["tensors_quantized"] == plan["quantized_tensors"]
    _, imported = _convert_in_child(_one_layer_config(checkpoints, tmp_path), tmp_path / "unsettled", "dry_run=True")
    assert "transformers.modeling_utils" in imported, "the check above could not have failed"


@SETTLES_HERE
def test_a_settled_dry_run_says_how_its_layout_was_decided(checkpoints, tmp_path):
    proc = run_cli("convert", str(checkpoints("llama")), str(tmp_path / "out"), "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert "decided by transformers meta model (LlamaForCausalLM) (its rules, from names and config.json: " \
           "verified for this transformers)" in proc.stdout
