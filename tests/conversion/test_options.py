"""convert()'s options: what a Python caller holds (torch dtypes, one skip pattern, a torch.device) is taken, and a
refusal names the option as its caller wrote it (a keyword argument from Python, a flag from the CLI)."""

from __future__ import annotations

import json
import shutil
import struct

import pytest
import torch
from helpers import run_main

import prequant
from prequant.conversion.options import ConvertOptions


def test_torch_dtypes_are_taken_as_quantize_tensor_takes_them(checkpoints, tmp_path):
    src = checkpoints("llama")
    plan = prequant.convert(src, tmp_path / "unused", dry_run=True, quant_storage=torch.uint8,
                            compute_dtype=torch.float16)
    assert (plan.settings.quant_storage, plan.settings.compute_dtype) == ("uint8", "float16")
    # The same bytes as the names give.
    prequant.convert(src, tmp_path / "dtypes", device=torch.device("cpu"), progress=False, stats=False,
                     quant_storage=torch.uint8, compute_dtype=torch.float16)
    prequant.convert(src, tmp_path / "names", device="cpu", progress=False, stats=False, quant_storage="uint8",
                     compute_dtype="float16")
    for name in ("model.safetensors", "config.json", "README.md"):
        assert (tmp_path / "dtypes" / name).read_bytes() == (tmp_path / "names" / name).read_bytes(), name
    options = json.loads((tmp_path / "dtypes" / "prequant.json").read_text())["options"]
    assert options["quant_storage"] == "uint8" and options["compute_dtype"] == "float16"


def test_one_skip_pattern_is_one_pattern_not_its_letters():
    assert ConvertOptions(skip="lm_head").skip == ("lm_head",)
    assert ConvertOptions(skip=["lm_head", "model.layers.0"]).skip == ("lm_head", "model.layers.0")


# (keyword arguments, what the Python refusal says, CLI arguments, what the CLI refusal says)
REFUSALS = [
    ({"quant_type": "nf5"}, "quant_type='nf5' is not supported; use nf4 or fp4",
     ["--quant-type", "nf5"], "--quant-type nf5 is not supported; use nf4 or fp4"),
    ({"blocksize": 100}, "blocksize=100 is not supported",
     ["--blocksize", "100"], "--blocksize 100 is not supported"),
    ({"compute_dtype": torch.int8}, "compute_dtype=torch.int8 is not supported; use bfloat16, float16 or float32",
     ["--compute-dtype", "int8"], "--compute-dtype int8 is not supported; use bfloat16, float16 or float32"),
    ({"quant_storage": torch.float64}, "quant_storage=torch.float64 is not supported",
     ["--quant-storage", "float64"], "--quant-storage float64 is not supported"),
    ({"max_shard_size": "lots"}, "max_shard_size='lots' is not a size",
     ["--max-shard-size", "lots"], "--max-shard-size lots is not a size"),
    ({"skip": "("}, "skip='(' is not a valid regular expression",
     ["--skip", "("], "--skip '(' is not a valid regular expression"),
    ({"base_model": "not a repo"}, "base_model='not a repo' is not a Hub repo id",
     ["--base-model", "not a repo"], "--base-model 'not a repo' is not a Hub repo id"),
    ({"device": "gpu"}, "device='gpu' is not a device", ["--device", "gpu"], "--device gpu is not a device"),
]


@pytest.mark.parametrize("keywords, python_says, args, cli_says", REFUSALS, ids=[next(iter(r[0])) for r in REFUSALS])
def test_a_refusal_names_the_option_as_its_caller_wrote_it(checkpoints, tmp_path, keywords, python_says, args,
                                                           cli_says):
    with pytest.raises(prequant.UsageError) as refused:
        prequant.convert(checkpoints("llama"), tmp_path / "out", dry_run=True, **keywords)
    assert python_says in str(refused.value) and "--" not in str(refused.value)
    code, stdout, stderr = run_main("convert", str(checkpoints("llama")), str(tmp_path / "out"), "--dry-run", *args)
    lines = stderr.strip().splitlines()
    assert code == 2 and stdout == "" and len(lines) == 1 and lines[0].startswith("Error: "), stderr
    assert cli_says in lines[0] and f"{next(iter(keywords))}=" not in lines[0], lines[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("job", ["convert", "merge"])
def test_a_gpu_asked_for_from_python_is_refused_in_python_words(checkpoints, tmp_path, job):
    from adapters import make_adapter

    run = (prequant.convert if job == "convert" else
           lambda src, out, **kw: prequant.merge(make_adapter(src, tmp_path / "lora"), out, base=src, **kw))
    with pytest.raises(prequant.UsageError) as refused:
        run(checkpoints("llama"), tmp_path / "out", dry_run=True, device="cuda")
    said = str(refused.value)
    assert "device='cuda' asked for, but no CUDA GPU is visible; use device='cpu'" in said and "--" not in said


@pytest.mark.parametrize("skip", [123, [1, 2], {"lm_head": 1}])
def test_a_skip_that_is_no_pattern_is_a_usage_error(checkpoints, tmp_path, skip):
    with pytest.raises(prequant.UsageError) as refused:
        prequant.convert(checkpoints("llama"), tmp_path / "out", dry_run=True, skip=skip)
    said = str(refused.value)
    assert said.startswith(f"skip={skip!r} is not a module name or pattern") and "skip=['lm_head']" in said


def test_a_taken_output_dir_is_refused_in_python_words(checkpoints, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(prequant.UsageError) as refused:
        prequant.convert(checkpoints("llama"), out, device="cpu", progress=False, resume=True)
    said = str(refused.value)
    assert "pass overwrite=True" in said and "resume=True only continues one" in said and "--" not in said


def test_another_job_in_a_finished_output_dir_is_refused_in_python_words(checkpoints, tmp_path):
    prequant.convert(checkpoints("llama"), tmp_path / "done", device="cpu", progress=False, stats=False)
    with pytest.raises(prequant.UsageError) as refused:
        prequant.convert(checkpoints("llama"), tmp_path / "done", device="cpu", progress=False, quant_type="fp4")
    said = str(refused.value)
    assert "(quant_type: 'nf4' there, 'fp4' here); pass overwrite=True" in said and "--" not in said


def test_names_in_any_case_are_taken_from_python_as_from_the_cli():
    options = ConvertOptions(compute_dtype="BFloat16", quant_type="NF4", quant_storage="UINT8")
    assert (options.compute_dtype, options.quant_type, options.quant_storage) == ("bfloat16", "nf4", "uint8")


def _poke_nan(path, tensor: str) -> None:
    """Make the first element of a bfloat16 tensor NaN, in place."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    begin = 8 + n + json.loads(raw[8 : 8 + n])[tensor]["data_offsets"][0]
    with open(path, "r+b") as f:
        f.seek(begin)
        f.write(b"\xc0\x7f")


# What the run finds in the tensors, at planning or while quantizing, deep below the options' checks:
# (tensor made NaN or None, keywords, what the Python error says, CLI arguments, what the CLI error says)
FOUND = [
    ("model.norm.weight", {}, "or pass allow_nan=True to copy it", [], "or pass --allow-nan to copy it"),
    ("model.layers.0.mlp.down_proj.weight", {}, "keep that module unquantized with "
     "skip=['model.layers.0.mlp.down_proj']", [], "keep that module unquantized with --skip model.layers.0.mlp.down_proj"),
    (None, {"delete_source_shards": True}, "delete_source_shards=True only applies to a Hub source",
     ["--delete-source-shards"], "--delete-source-shards only applies to a Hub source"),
    (None, {"skip": ["model"]}, "check the source, or skip patterns", ["--skip", "model"],
     "check the source, or --skip patterns"),
]


@pytest.mark.parametrize("nan, keywords, python_says, args, cli_says", FOUND,
                         ids=["kept NaN", "quantized NaN", "delete a local source", "nothing to quantize"])
def test_what_the_run_finds_is_said_in_its_callers_words(checkpoints, tmp_path, nan, keywords, python_says, args,
                                                          cli_says):
    src = shutil.copytree(checkpoints("llama"), tmp_path / "src")
    if nan is not None:
        _poke_nan(src / "model.safetensors", nan)
    with pytest.raises(prequant.PrequantError) as refused:
        prequant.convert(src, tmp_path / "py", device="cpu", progress=False, **keywords)
    assert python_says in str(refused.value) and "--" not in str(refused.value), str(refused.value)
    code, stdout, stderr = run_main("convert", str(src), str(tmp_path / "cli"), "--device", "cpu", *args)
    lines = stderr.strip().splitlines()
    assert code in (1, 2) and stdout == "" and lines[-1].startswith("Error: "), stderr
    assert cli_says in lines[-1] and "=" not in lines[-1].split(cli_says)[0][-20:], lines[-1]
