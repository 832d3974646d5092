"""prequant change-storage: one conversion, two storages (bf16 for FSDP, uint8 for vLLM/SGLang), same packed bytes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import read_checkpoint, run_main
from safetensors.torch import save_file

import prequant
from prequant.conversion.storage import change_storage
from prequant.errors import PrequantError, UsageError
from prequant.verify.run import verify


def _files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def both(checkpoints, tmp_path_factory):
    """(source, bf16 output, uint8 output) of the same tiny Llama, two shards each, converted directly."""
    src = checkpoints("llama")
    root = tmp_path_factory.mktemp("storages")
    for storage in ("bfloat16", "uint8"):
        prequant.convert(src, root / storage, device="cpu", progress=False, max_shard_size="100KB",
                         quant_storage=storage)
    return src, root / "bfloat16", root / "uint8"


def _but_the_job(folder: Path) -> tuple[dict[str, bytes], dict, object]:
    """The files byte for byte, except prequant.json: parsed, without its "job" fingerprint, which is returned
    apart (change-storage cannot recompute a conversion's job: it records none)."""
    files = _files(folder)
    manifest = json.loads(files.pop("prequant.json"))
    return files, manifest, manifest.pop("job")


def test_result_is_what_convert_writes_with_that_storage(both, tmp_path):
    _, bf16, uint8 = both
    change_storage(bf16, tmp_path / "out", "uint8", progress=False)
    files, manifest, job = _but_the_job(tmp_path / "out")
    want_files, want_manifest, want_job = _but_the_job(uint8)
    assert files == want_files  # shards, config, index, card: byte for byte
    bf16_job = json.loads((bf16 / "prequant.json").read_text())["job"]
    assert manifest.pop("job_by_storage") == {"bfloat16": bf16_job}  # restored by a change back
    assert manifest == want_manifest and job is None and isinstance(want_job, str)


def test_convert_resume_does_not_take_a_changed_storage_for_its_own_finished_job(both, tmp_path):
    """With the bf16 conversion's job kept, `convert --resume` of those options would call a uint8 output complete."""
    src, bf16, _ = both
    out = tmp_path / "out"
    change_storage(bf16, out, "uint8", progress=False)
    before = _files(out)
    with pytest.raises(UsageError, match="no conversion of these options wrote"):
        prequant.convert(src, out, device="cpu", progress=False, max_shard_size="100KB", resume=True)
    assert _files(out) == before


def test_bf16_to_uint8_to_bf16_gives_back_every_byte_and_verifies(both, tmp_path):
    _, bf16, _ = both
    change_storage(bf16, tmp_path / "u8", "uint8", progress=False)
    assert verify(tmp_path / "u8", progress=False).ok
    change_storage(tmp_path / "u8", tmp_path / "back", "bfloat16", progress=False)
    report = verify(tmp_path / "back", progress=False)
    assert report.ok and not report.warnings, report.to_text()
    assert json.loads((tmp_path / "u8" / "prequant.json").read_text())["job"] is None
    assert _files(tmp_path / "back") == _files(bf16)  # the conversion's own job fingerprint back too


def test_verify_against_the_source_passes_and_values_are_the_same(both, tmp_path):
    import bitsandbytes.functional as bnbf
    from bitsandbytes.functional import QuantState

    src, bf16, _ = both
    change_storage(bf16, tmp_path / "u8", "uint8", progress=False)
    assert verify(tmp_path / "u8", src, progress=False).ok
    a, b = read_checkpoint(bf16), read_checkpoint(tmp_path / "u8")
    weights = [k.split(".quant_state.")[0] for k in a if ".quant_state." in k]
    assert len(weights) == 14
    for w in weights:
        assert b[w].dtype == torch.uint8 and a[w].dtype == torch.bfloat16
        values = []
        for ckpt in (a, b):
            state = QuantState.from_dict({k: v for k, v in ckpt.items() if k.startswith(w + ".")}, device="cpu")
            values.append(bnbf.dequantize_4bit(ckpt[w].view(torch.uint8).reshape(-1, 1), state))
        assert torch.equal(values[0], values[1]), w


def test_cli_prints_what_it_did_and_refuses_the_same_storage(both, tmp_path):
    _, bf16, _ = both
    code, out, err = run_main("change-storage", str(bf16), str(tmp_path / "u8"), "--quant-storage", "uint8", "--json")
    assert code == 0, err
    result = json.loads(out)
    assert (result["old_storage"], result["new_storage"], result["packed_weights"], result["card"]) == (
        "bfloat16", "uint8", 14, "rewritten")
    code, _, err = run_main("change-storage", str(bf16), str(tmp_path / "again"), "--quant-storage", "bfloat16")
    assert code == 2 and "already stored as bfloat16" in err and not (tmp_path / "again").exists()


def test_an_input_that_does_not_verify_is_refused(both, tmp_path):
    _, bf16, _ = both
    damaged = Path(shutil.copytree(bf16, tmp_path / "damaged"))
    shard = damaged / "model-00002-of-00002.safetensors"
    data = bytearray(shard.read_bytes())
    data[-2000] ^= 0x10
    shard.write_bytes(data)
    with pytest.raises(PrequantError, match="refusing to change the storage.*model-00002-of-00002.safetensors"):
        change_storage(damaged, tmp_path / "out", "uint8", progress=False)
    assert not (tmp_path / "out").exists()


def test_an_edited_card_is_kept_and_said(both, tmp_path):
    _, bf16, _ = both
    edited = Path(shutil.copytree(bf16, tmp_path / "edited"))
    (edited / "README.md").write_text((edited / "README.md").read_text() + "\nMy own notes.\n")
    result = change_storage(edited, tmp_path / "out", "uint8", progress=False)
    assert result.card == "kept as edited" and "README.md was edited" in result.warnings[0]
    assert (tmp_path / "out" / "README.md").read_text().endswith("My own notes.\n")
    report = verify(tmp_path / "out", progress=False)
    assert report.ok and [w.where for w in report.warnings] == ["README.md"]  # still said to be edited


@pytest.fixture(scope="module")
def odd(tmp_path_factory):
    """A source whose one linear weight has 5 x 65 = 325 elements: 163 bytes of codes, which bfloat16 storage
    (bitsandbytes sizes it (n + 1) // 4 elements: 162 bytes) cannot hold."""
    src = tmp_path_factory.mktemp("odd") / "src"
    src.mkdir()
    save_file({"blocks.0.proj.weight": torch.randn(5, 65).bfloat16(), "blocks.0.norm.weight": torch.ones(65).bfloat16()},
              src / "model.safetensors", metadata={"format": "pt"})
    (src / "config.json").write_text(json.dumps({"architectures": ["Unknown"], "model_type": "unknown"}))
    return src


def test_wider_storage_that_would_drop_a_byte_is_refused_by_name(odd, tmp_path):
    prequant.convert(odd, tmp_path / "u8", device="cpu", progress=False, quant_storage="uint8")
    with pytest.raises(PrequantError) as error:
        change_storage(tmp_path / "u8", tmp_path / "out", "bfloat16", progress=False)
    assert str(error.value).startswith("blocks.0.proj.weight: its 325 4-bit codes take 163 bytes, which bfloat16")
    assert "convert the original again with skip=['blocks.0.proj']" in str(error.value)
    assert "--" not in str(error.value) and not (tmp_path / "out").exists()


def _as_bnb_stores_it_in_bf16(u8: Path) -> Path:
    """A uint8-storage output rewritten as bitsandbytes (and prequant before it refused such counts) stores it in
    bfloat16: (n + 1) // 4 words per packed weight, so an odd code count loses its last byte; config and manifest
    updated so that the folder verifies as such a checkpoint would."""
    from safetensors.torch import load_file

    from prequant.checkpoint.manifest import sha256_file

    shard = u8 / "model.safetensors"
    tensors = load_file(shard)
    config = json.loads((u8 / "config.json").read_text())
    for name, t in list(tensors.items()):
        if t.dtype == torch.uint8 and name.endswith(".weight") and f"{name}.quant_state.bitsandbytes__nf4" in tensors:
            n = len(t) * 2 - 1  # 325 codes in 163 bytes
            words = (n + 1) // 4
            tensors[name] = t.reshape(-1)[: 2 * words].view(torch.bfloat16).reshape(words, 1).clone()
    save_file(tensors, shard, metadata={"format": "pt"})
    config["quantization_config"]["bnb_4bit_quant_storage"] = "bfloat16"
    (u8 / "config.json").write_text(json.dumps(config, indent=2))
    manifest = json.loads((u8 / "prequant.json").read_text())
    manifest["options"]["quant_storage"] = "bfloat16"
    for name in ("model.safetensors", "config.json"):
        manifest["files"][name] = {"size": (u8 / name).stat().st_size, "sha256": sha256_file(u8 / name)}
    (u8 / "prequant.json").write_text(json.dumps(manifest, indent=2))
    return u8


def test_a_wide_storage_that_already_dropped_a_byte_cannot_become_uint8(odd, tmp_path):
    prequant.convert(odd, tmp_path / "bf16", device="cpu", progress=False, quant_storage="uint8")
    _as_bnb_stores_it_in_bf16(tmp_path / "bf16")
    with pytest.raises(PrequantError) as error:
        change_storage(tmp_path / "bf16", tmp_path / "out", "uint8", progress=False)
    assert str(error.value).startswith("blocks.0.proj.weight: its 325 4-bit codes need 163 bytes but its BF16")
    assert "convert the original again with quant_storage='uint8'" in str(error.value)
    code, _, stderr = run_main("change-storage", str(tmp_path / "bf16"), str(tmp_path / "cli"), "--quant-storage",
                               "uint8")
    assert code == 1 and "convert the original again with --quant-storage uint8" in stderr, stderr


def test_unknown_storage_is_a_usage_error(both, tmp_path):
    with pytest.raises(UsageError, match="int4"):
        change_storage(both[1], tmp_path / "out", "int4", progress=False)


def test_the_cli_takes_a_storage_name_in_any_case_as_convert_does(both, tmp_path):
    _, bf16, uint8 = both
    code, _, stderr = run_main("change-storage", str(bf16), str(tmp_path / "out"), "--quant-storage", "UINT8")
    assert code == 0, stderr
    assert _but_the_job(tmp_path / "out")[0] == _but_the_job(uint8)[0]


def test_a_torch_dtype_is_taken_and_a_refusal_names_the_option_as_its_caller_wrote_it(both, tmp_path):
    _, bf16, uint8 = both
    change_storage(bf16, tmp_path / "out", torch.uint8, progress=False)
    assert _but_the_job(tmp_path / "out")[0] == _but_the_job(uint8)[0]  # what "uint8" gives
    with pytest.raises(UsageError) as refused:
        change_storage(bf16, tmp_path / "nope", torch.float64, progress=False)
    assert str(refused.value).startswith("quant_storage=torch.float64 is not supported; use bfloat16, float16")
    code, stdout, stderr = run_main("change-storage", str(bf16), str(tmp_path / "nope"), "--quant-storage", "int4")
    assert code == 2 and stdout == "" and stderr.strip() == (
        "Error: --quant-storage int4 is not supported; use bfloat16, float16, float32 or uint8")
    assert not (tmp_path / "nope").exists()


def test_the_destination_is_called_dest_not_output_dir(both, tmp_path):
    """change-storage's OUTPUT_DIR is its input; where it writes is DEST, in its help and in its refusals."""
    _, bf16, _ = both
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("mine")
    code, _, stderr = run_main("change-storage", str(bf16), str(taken), "--quant-storage", "uint8")
    assert code == 2 and stderr.startswith(f"Error: DEST {taken} is not empty (it holds notes.txt)"), stderr
    assert "OUTPUT_DIR" not in stderr and (taken / "notes.txt").read_text() == "mine"
    code, _, stderr = run_main("change-storage", str(bf16), str(bf16 / "inside"), "--quant-storage", "uint8")
    assert code == 2 and stderr.startswith(f"Error: DEST {bf16 / 'inside'} is inside the source directory"), stderr
    assert "OUTPUT_DIR" not in stderr and not (bf16 / "inside").exists()
    code, stdout, _ = run_main("change-storage", "--help")
    assert "DEST" in stdout and "a new or empty" in " ".join(stdout.split())


def test_a_taken_dest_refused_in_python_names_the_keyword(both, tmp_path):
    _, bf16, _ = both
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("mine")
    with pytest.raises(UsageError) as error:
        change_storage(bf16, taken, "uint8", progress=False)
    assert "pass overwrite=True" in str(error.value) and "--overwrite" not in str(error.value)
    assert (taken / "notes.txt").read_text() == "mine"


def test_a_finished_change_run_again_says_already_complete_and_writes_nothing(both, tmp_path):
    """As convert and merge say of a finished job: the same command again exits 0, writes nothing, says no speed."""
    _, bf16, _ = both
    args = ("change-storage", str(bf16), str(tmp_path / "u8"), "--quant-storage", "uint8")
    code, _, err = run_main(*args)
    assert code == 0, err
    before = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in (tmp_path / "u8").iterdir()}
    code, out, err = run_main(*args)
    assert code == 0, err
    assert out.startswith(f"already complete: {tmp_path / 'u8'} holds this change of {bf16}"), out
    assert "GB copied" not in out and " s" not in out.split("(")[0]
    assert {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in (tmp_path / "u8").iterdir()} == before
    code, out, err = run_main(*args, "--json")
    assert code == 0 and json.loads(out)["already_complete"] is True, err


def test_a_finished_change_is_found_without_verifying_the_input_again(both, tmp_path, monkeypatch):
    """Finding DEST complete reads the records and headers only: no shard of the input is hashed again."""
    _, bf16, _ = both
    first = change_storage(bf16, tmp_path / "u8", "uint8", progress=False)
    monkeypatch.setattr("prequant.conversion.storage.verify", lambda *a, **k: pytest.fail("verified again"))
    again = change_storage(bf16, tmp_path / "u8", "uint8", progress=False)
    assert again.already_complete and (again.card, again.packed_weights, again.shards) == (
        first.card, first.packed_weights, first.shards)


def test_a_finished_change_with_an_edited_card_says_it_was_kept(both, tmp_path):
    _, bf16, _ = both
    edited = tmp_path / "edited"
    shutil.copytree(bf16, edited)
    text = (edited / "README.md").read_text()
    (edited / "README.md").write_text(text.replace("bitsandbytes", "BitsAndBytes", 1))  # the size it records
    assert (edited / "README.md").read_text() != text
    first = change_storage(edited, tmp_path / "u8", "uint8", progress=False)
    again = change_storage(edited, tmp_path / "u8", "uint8", progress=False)
    assert first.card == "kept as edited" and again.already_complete and again.card == "kept as edited"


def test_another_change_into_a_finished_dest_is_still_refused(both, tmp_path):
    _, bf16, _ = both
    code, _, err = run_main("change-storage", str(bf16), str(tmp_path / "out"), "--quant-storage", "uint8")
    assert code == 0, err
    code, _, err = run_main("change-storage", str(bf16), str(tmp_path / "out"), "--quant-storage", "float16")
    assert code == 2 and "DEST" in err and "--overwrite" in err, err
