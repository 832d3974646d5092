"""prequant verify: passes fresh outputs, fails closed (one line naming the file or tensor) on damage."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import rehash, run_cli, run_main
from safetensors.torch import load_file, save_file

import prequant
from prequant.bnb import stats
from prequant.bnb.stats import entry_stats
from prequant.verify import check, compare, run as verification

SHARD_1 = "model-00001-of-00002.safetensors"
SHARD_2 = "model-00002-of-00002.safetensors"
INDEX = "model.safetensors.index.json"


@pytest.fixture
def out(converted_llama, tmp_path) -> Path:
    """A private copy of the fresh output (conftest's converted_llama, shared read-only), to damage."""
    return Path(shutil.copytree(converted_llama[1], tmp_path / "out"))


def rewrite_shard(out: Path, key: str, edit) -> str:
    """Apply `edit(tensors)` to the shard holding `key`; return that shard's name."""
    shard = json.loads((out / INDEX).read_text())["weight_map"][key]
    tensors = load_file(out / shard)
    edit(tensors)
    save_file(tensors, out / shard, metadata={"format": "pt"})
    return shard


def first_problem(out: Path, source: Path | None = None) -> str:
    report = verification.verify(out, source, progress=False)
    assert not report.ok
    return str(report.problems[0])


def test_fresh_output_passes(converted_llama):
    src, out = converted_llama
    report = verification.verify(out, src, progress=False)
    assert report.ok, report.to_text()
    assert report.files["checked"] == report.files["listed"] == 8
    assert report.tensors["quantized"] == 14 and report.source["quantized"] == 14 and report.source["kept"] == 7
    assert 0.07 < report.source["summary"]["max_rel_error"] < 0.12


def test_cli_json_report_and_exit_zero(converted_llama):
    src, out = converted_llama
    proc = run_cli("verify", str(out), "--source", str(src), "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["ok"] is True and report["problems"] == []
    assert set(report["source"]["tensors"]) == set(json.loads((out / "prequant.json").read_text())["tensors"])


def test_flipped_byte_fails_with_one_line_naming_the_file(out):
    data = bytearray((out / SHARD_2).read_bytes())
    data[-1000] ^= 0x01
    (out / SHARD_2).write_bytes(data)
    proc = run_cli("verify", str(out))
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: verification failed: ") and SHARD_2 in lines[0]
    assert "sha256" in lines[0] and "FAILED" in proc.stdout


def test_failed_json_report_is_parsed(out):
    (out / SHARD_1).unlink()
    code, stdout, stderr = run_main("verify", str(out), "--json")
    assert code == 1 and SHARD_1 in stderr.strip()
    report = json.loads(stdout)
    assert report["ok"] is False and report["problems"][0]["where"] == SHARD_1


def test_missing_shard(out):
    (out / SHARD_2).unlink()
    problem = first_problem(out)
    assert problem.startswith(SHARD_2) and "missing" in problem


def test_truncated_shard(out):
    data = (out / SHARD_1).read_bytes()
    (out / SHARD_1).write_bytes(data[:-64])
    assert first_problem(out).startswith(f"{SHARD_1}: ") and "truncated" in first_problem(out)
    rehash(out, SHARD_1)  # even with a matching manifest, the header's offsets give it away
    assert first_problem(out).startswith(SHARD_1) and "truncated" in first_problem(out)


def test_missing_companion_tensor(out):
    key = "model.layers.0.mlp.down_proj.weight.absmax"
    shard = rewrite_shard(out, key, lambda t: t.pop(key))
    assert first_problem(out).startswith(shard)  # the manifest catches the edit first
    index = json.loads((out / INDEX).read_text())
    del index["weight_map"][key]
    (out / INDEX).write_text(json.dumps(index))
    rehash(out, shard, INDEX)
    problem = first_problem(out)
    assert problem.startswith(f"{key}: missing")


def test_edited_config(out):
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"]["bnb_4bit_quant_type"] = "fp4"
    (out / "config.json").write_text(json.dumps(config, indent=2))
    assert first_problem(out).startswith("config.json: ")
    rehash(out, "config.json")
    problem = first_problem(out)
    assert problem.startswith("config.json: bnb_4bit_quant_type is 'fp4' but the tensors are nf4")


def test_config_skipping_a_quantized_module(out):
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"]["llm_int8_skip_modules"] = ["lm_head", "down_proj"]
    (out / "config.json").write_text(json.dumps(config))
    rehash(out, "config.json")
    assert first_problem(out).startswith("model.layers.0.mlp.down_proj.weight: is 4-bit, but llm_int8_skip_modules")


def test_index_naming_the_wrong_shard(out):
    index = json.loads((out / INDEX).read_text())
    # A key of a shard that holds others too: the index still names that shard, so verify reads it.
    shards = list(index["weight_map"].values())
    key, stored = next((k, v) for k, v in index["weight_map"].items() if shards.count(v) > 1)
    listed = SHARD_2 if stored == SHARD_1 else SHARD_1
    index["weight_map"][key] = listed
    (out / INDEX).write_text(json.dumps(index))
    rehash(out, INDEX)
    assert first_problem(out) == f"{key}: listed in {INDEX} under {listed}, but stored in {stored}"


def test_damaged_quant_state(out):
    key = "model.layers.0.mlp.up_proj.weight.quant_state.bitsandbytes__nf4"

    def edit(tensors):
        state = json.loads(bytes(tensors[key].tolist()))
        state["blocksize"] = 128
        tensors[key] = torch.tensor(list(json.dumps(state).encode()), dtype=torch.uint8)

    rehash(out, rewrite_shard(out, key, edit))
    problem = first_problem(out)  # blocksize 128 implies half as many absmax entries
    assert problem.startswith("model.layers.0.mlp.up_proj.weight.absmax: shape [128]")


def test_stray_checkpoint_file_fails_other_files_warn(out):
    (out / "notes.txt").write_text("mine")
    report = verification.verify(out, progress=False)
    assert report.ok and report.extra_files == ["notes.txt"] and report.warnings[0].where == "notes.txt"
    (out / "model-00003-of-00002.safetensors").write_bytes(b"stale")
    assert first_problem(out).startswith("model-00003-of-00002.safetensors: not listed in prequant.json")


def test_missing_manifest(out):
    (out / "prequant.json").unlink()
    assert first_problem(out).startswith("prequant.json: missing")


def test_source_catches_swapped_tensors_that_hash_fine(converted_llama, out):
    """Structure and hashes cannot tell two same-shaped tensors apart; the source comparison can."""
    src, _ = converted_llama
    a, b = "model.layers.1.mlp.gate_proj.weight", "model.layers.1.mlp.up_proj.weight"

    def swap(tensors):
        for suffix in ("", ".absmax", ".nested_absmax"):
            tensors[a + suffix], tensors[b + suffix] = tensors[b + suffix], tensors[a + suffix]

    rehash(out, rewrite_shard(out, a, swap))
    assert verification.verify(out, progress=False).ok
    problem = first_problem(out, src)
    assert problem.startswith(f"{a}: relative error 1.") and "exceeds the limit 0.368" in problem


def test_source_catches_an_edited_kept_tensor(converted_llama, out):
    src, _ = converted_llama
    key = "model.norm.weight"
    rehash(out, rewrite_shard(out, key, lambda t: t[key].mul_(2)))
    assert first_problem(out, src) == f"{key}: kept unquantized, but its bytes differ from the source"


def test_rel_error_limit_is_configurable(converted_llama):
    src, out = converted_llama
    code, stdout, stderr = run_main("verify", str(out), "--source", str(src), "--max-rel-error", "0.05", "--json")
    assert code == 1 and "exceeds the limit 0.05" in stderr
    assert all("exceeds the limit 0.05" in p["message"] for p in json.loads(stdout)["problems"])


def test_a_limit_below_the_formats_own_error_does_not_call_the_data_wrong(converted_llama):
    """NF4's normal rounding error (about 0.092 at block 64) over a tight limit: the data matches the source."""
    src, out = converted_llama
    code, stdout, stderr = run_main("verify", str(out), "--source", str(src), "--max-rel-error", "0.05", "--json")
    assert code == 1, stderr
    problems = json.loads(stdout)["problems"]
    assert problems and all("is the rounding error these 4-bit settings give" in p["message"] for p in problems)
    assert "does not match the source" not in stdout + stderr


def test_heavy_tailed_tensor_is_flagged_as_outlier_not_failed():
    torch.manual_seed(0)
    x = (torch.distributions.StudentT(3.0).sample((256, 1024)) * 0.02).bfloat16()
    st = entry_stats(x, prequant.quantize_tensor(x, blocksize=1024))
    expected = stats.expected_rel_error("nf4", 1024)
    report = check.Report("out")
    compare._judge("w", st, expected=expected, limit=compare.FAIL_FACTOR * expected, report=report)
    assert report.ok and report.warnings and "outlier" in report.warnings[0].message


def test_not_a_directory_is_a_usage_error(tmp_path):
    code, _, stderr = run_main("verify", str(tmp_path / "nope"))
    assert code == 2 and stderr.startswith("Error: OUTPUT_DIR") and len(stderr.strip().splitlines()) == 1


def edit_manifest(out: Path, edit) -> None:
    """Apply `edit(manifest)` to prequant.json (it lists the other files, not itself: nothing to rehash)."""
    manifest = json.loads((out / "prequant.json").read_text())
    edit(manifest)
    (out / "prequant.json").write_text(json.dumps(manifest))


def test_gpt2_conv1d_output_passes_against_its_source(converted_gpt2, tmp_path):
    """Conv1D weights are quantized transposed; the square attn.c_proj ([64, 64]) looks the same either way,
    so verify must take the planner's decision (recorded in prequant.json), not guess from shapes."""
    src, fresh_out = converted_gpt2
    report = verification.verify(fresh_out, src, progress=False)
    assert report.ok, report.to_text()
    assert report.source["quantized"] == 8 and "transformer.h.0.attn.c_proj.weight" in report.source["tensors"]
    assert report.source["summary"]["max_rel_error"] < 0.12

    # Older manifests lack the record: verify decides from the source's architecture, as convert did.
    out = Path(shutil.copytree(fresh_out, tmp_path / "out"))
    edit_manifest(out, lambda m: m.pop("transposed"))
    report = verification.verify(out, src, progress=False)
    assert report.ok, report.to_text()
    assert report.source["summary"]["max_rel_error"] < 0.12

    # The record is what verify uses: one that omits c_proj makes it compare the wrong layout.
    edit_manifest(out, lambda m: m.update(transposed=[n for n in m["tensors"] if not n.endswith("attn.c_proj.weight")]))
    assert first_problem(out, src).startswith("transformer.h.0.attn.c_proj.weight: relative error 1.")


def test_gpt2_record_naming_a_non_square_tensor_wrongly_fails_on_shape(converted_gpt2, tmp_path):
    src, fresh_out = converted_gpt2
    out = Path(shutil.copytree(fresh_out, tmp_path / "out"))
    edit_manifest(out, lambda m: m.update(transposed=[]))  # c_attn is [64, 192] in the source, [192, 64] quantized
    problem = first_problem(out, src)
    assert problem == "transformer.h.0.attn.c_attn.weight: quant state shape [192, 64] does not match the source's [64, 192]"


def test_older_manifest_and_a_source_without_config_fail_closed(converted_gpt2, tmp_path):
    src, fresh_out = converted_gpt2
    out = Path(shutil.copytree(fresh_out, tmp_path / "out"))
    edit_manifest(out, lambda m: m.pop("transposed"))
    bare = Path(shutil.copytree(src, tmp_path / "src"))
    (bare / "config.json").unlink()
    problem = first_problem(out, bare)
    assert problem.startswith("prequant.json: does not record which tensors were quantized transposed") and (
        "config.json is missing" in problem
    )


def test_malformed_index(out):
    (out / INDEX).write_text('{"weight_map": ["not", "a", "map"]}')
    rehash(out, INDEX)
    assert first_problem(out).startswith(f"{INDEX}: not a valid index (needs a 'weight_map' object")


def test_weights_near_1e30_verify_against_their_source(checkpoints, tmp_path):
    """Their float32 error norm would overflow: convert records a finite error, verify --source passes."""
    src = Path(shutil.copytree(checkpoints("llama"), tmp_path / "src"))
    tensors = load_file(src / "model.safetensors")
    name = "model.layers.0.mlp.up_proj.weight"
    tensors[name] = (tensors[name].float() * 1e30).to(torch.bfloat16)
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "out"
    prequant.convert(src, out, device="cpu", progress=False)
    recorded = json.loads((out / "prequant.json").read_text())["tensors"][name]
    assert recorded["rel_error"] is not None and 0.05 < recorded["rel_error"] < 0.12
    report = verification.verify(out, src, progress=False)
    assert report.ok, report.to_text()
    assert report.source["tensors"][name]["rel_error"] == recorded["rel_error"]


def test_an_edited_card_is_a_warning_not_a_failure(out):
    (out / "README.md").write_text((out / "README.md").read_text().replace("# ", "# My ", 1))
    report = verification.verify(out, progress=False)
    assert report.ok, report.to_text()
    assert [(w.where, w.message.split(" (")[0]) for w in report.warnings] == [("README.md", "edited since the conversion")]
    (out / "README.md").write_text((out / "README.md").read_text() + "more")  # a size change too
    assert verification.verify(out, progress=False).ok


def test_a_limit_without_a_source_is_a_usage_error(converted_llama):
    """--max-rel-error limits the error against the source: without --source it would be ignored, silently."""
    _, out = converted_llama
    code, stdout, stderr = run_main("verify", str(out), "--max-rel-error", "0.2")
    lines = stderr.strip().splitlines()
    assert code == 2 and stdout == "" and len(lines) == 1, stderr
    assert lines[0].startswith("Error: --max-rel-error 0.2 limits") and "--source SOURCE" in lines[0]
    with pytest.raises(prequant.UsageError) as refused:  # from Python, in its keywords
        verification.verify(out, max_rel_error=0.2, progress=False)
    assert str(refused.value).startswith("max_rel_error=0.2 limits") and "source=" in str(refused.value)
    assert "--" not in str(refused.value)


@pytest.mark.parametrize("kind", ["plain checkpoint", "empty folder"])
def test_a_folder_that_is_not_a_prequant_output_is_said_in_one_line(checkpoints, tmp_path, kind):
    folder = checkpoints("llama") if kind == "plain checkpoint" else tmp_path
    code, stdout, stderr = run_main("verify", str(folder))
    assert code == 1 and stdout == "", stdout  # no report saying its (absent) quantization_config "agrees"
    assert stderr.strip() == (f"Error: OUTPUT_DIR {folder} is not a prequant output: it has no prequant.json, and no "
                              "config.json with a quantization_config; pass the folder prequant convert wrote")


def test_a_failing_source_comparison_says_no_none(converted_llama):
    """The output itself given as the source: convert refuses it (already quantized), nothing quantized compares,
    and the report says so in words."""
    _, out = converted_llama
    code, stdout, stderr = run_main("verify", str(out), "--source", str(out))
    assert code == 1 and "None" not in stdout and "None" not in stderr, stdout
    assert f"FAIL source {out / 'config.json'}: the source is already quantized" in stdout
    assert f"source {out}: no quantized tensor compared, 77 kept tensors compared byte for byte" in stdout
    assert "FAILED (15 problems)" in stdout and "(and 14 more problems; see the full report)" in stderr


def test_a_missing_config_entry_is_said_missing_and_one_problem_is_one(out):
    config = json.loads((out / "config.json").read_text())
    del config["quantization_config"]["bnb_4bit_quant_type"]
    (out / "config.json").write_text(json.dumps(config))
    rehash(out, "config.json")
    report = verification.verify(out, progress=False)
    assert [str(p) for p in report.problems] == ["config.json: bnb_4bit_quant_type is missing but the tensors are nf4"]
    assert "FAILED (1 problem)\n" in report.to_text() and "None" not in report.to_text()
    assert "quantization_config DISAGREES with the tensors" in report.to_text()
    assert "tensors: 91 keys in 2 shards" in report.to_text()
