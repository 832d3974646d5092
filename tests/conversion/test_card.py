"""The output's model card (README.md): metadata, the original card and its licence carried, how to load it."""

from __future__ import annotations

import json
import shutil

import pytest
from helpers import run_main
from huggingface_hub import ModelCard

import prequant
from prequant.conversion import card


def test_card_metadata_and_original_card(carded_converted):
    card = ModelCard.load(carded_converted / "README.md")
    data = card.data.to_dict()
    # A local folder is no Hub repo: the metadata links none (its name is in the text, and the loading examples).
    assert "base_model" not in data and "base_model_relation" not in data
    assert data["library_name"] == "transformers"
    assert {"bitsandbytes", "4-bit", "nf4", "prequant", "text-generation"} <= set(data["tags"])
    # The licence and its gate travel with the weights.
    assert (data["license"], data["license_name"], data["license_link"]) == ("other", "tiny-licence", "LICENSE")
    assert data["extra_gated_prompt"] == "Accept the tiny licence first." and data["language"] == "en"
    text = card.text
    assert "## Original model card" in text and "Trained on nothing; for tests only." in text
    assert 'from_pretrained("tiny-llama-bnb-4bit-nf4", device_map="auto", dtype=torch.bfloat16)' in text  # 4.x, FSDP
    assert "`lm_head`" in text or "output embedding" in text  # what stayed unquantized
    # ... exactly: the tiny Llama's lm_head (256 x 64) is left out as the output embedding, and its token
    # embedding (256 x 64) and five RMSNorm weights (64 each) are not linear weights.
    assert "| `llm_int8_skip_modules` | transformers' defaults |\n| tensors quantized / kept | 14 / 7 |\n" in text
    assert (
        "Left unquantized (original dtype):\n\n"
        "- 16,384 parameters (skipped: output embedding / tied / last module)\n"
        "- 16,704 parameters (not a linear weight)\n\n"
        "## How to load\n"
    ) in text
    assert "relative L2 error median 0.09" in text  # the verification summary


def test_source_readme_is_replaced_not_copied(carded_source, carded_converted):
    summary_files = json.loads((carded_converted / "prequant.json").read_text())["files"]
    assert "README.md" in summary_files
    assert (carded_converted / "README.md").read_text() != (carded_source / "README.md").read_text()


def test_card_without_original_and_with_broken_yaml(checkpoints, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(checkpoints("llama"), src)
    prequant.convert(src, tmp_path / "a", device="cpu", progress=False, stats=False)
    plain = ModelCard.load(tmp_path / "a" / "README.md")
    assert "Original model card" not in plain.text and "not recorded" in plain.text
    (src / "README.md").write_text("---\nlicense: [unclosed\n---\nStill the original words.\n")
    prequant.convert(src, tmp_path / "b", device="cpu", progress=False, stats=False)
    card = (tmp_path / "b" / "README.md").read_text()
    assert "license: [unclosed" in card and "Still the original words." in card  # kept verbatim, not dropped
    assert ModelCard.load(tmp_path / "b" / "README.md").data.base_model is None


def _card(out):
    return ModelCard.load(out / "README.md")


def test_base_model_from_a_hub_cache_snapshot_path(checkpoints, tmp_path):
    """A Hub download passed by its path (the Hugging Face cache's snapshot folder) names the repo, not `<sha>`."""
    snapshot = tmp_path / "hub" / "models--my-org--tiny-llama" / "snapshots" / "0123abcd"
    shutil.copytree(checkpoints("llama"), snapshot)
    prequant.convert(snapshot, tmp_path / "out", device="cpu", progress=False, stats=False)
    card = _card(tmp_path / "out")
    assert card.data.base_model == "my-org/tiny-llama"
    assert "[`my-org/tiny-llama`](https://huggingface.co/my-org/tiny-llama)" in card.text


def test_base_model_option_names_the_repo_of_a_local_source(checkpoints, tmp_path):
    prequant.convert(checkpoints("llama"), tmp_path / "out", device="cpu", progress=False, stats=False,
                     base_model="meta-llama/Llama-3.1-8B")
    card = _card(tmp_path / "out")
    assert card.data.base_model == "meta-llama/Llama-3.1-8B"
    assert 'from_pretrained("Llama-3.1-8B-bnb-4bit-nf4", device_map="auto")' in card.text


def test_uint8_card_shows_vllm_and_bf16_card_says_how_to_get_there(checkpoints, tmp_path):
    prequant.convert(checkpoints("llama"), tmp_path / "u8", device="cpu", progress=False, stats=False,
                     quant_storage="uint8")
    text = _card(tmp_path / "u8").text
    assert 'quantization="bitsandbytes")' in text and "vllm serve" in text
    assert "--quant-storage bfloat16" in text  # FSDP needs the training dtype
    prequant.convert(checkpoints("llama"), tmp_path / "bf16", device="cpu", progress=False, stats=False)
    text = _card(tmp_path / "bf16").text
    assert "vllm serve" not in text and "prequant change-storage DIR DIR-uint8 --quant-storage uint8" in text
    assert "torch_dtype" not in text


def test_fused_moe_card_plan_and_summary_say_it_in_one_sentence(checkpoints, tmp_path):
    """Tiny Mixtral: transformers 5 fuses its experts, which bitsandbytes does not quantize: most parameters stay."""
    src = checkpoints("mixtral")
    plan = prequant.convert(src, tmp_path / "unused", dry_run=True)
    note = plan.fused_experts_note()
    assert note.startswith("77% of the parameters (196,608 of 254,784) stay unquantized: transformers 5 fuses")
    assert note.count(". ") == 0 and "bitsandbytes quantizes only nn.Linear" in note
    assert f"note: {note}" in plan.to_text() and note in plan.to_dict()["notes"]
    summary = prequant.convert(src, tmp_path / "out", device="cpu", progress=False, stats=False)
    assert f"note: {note}" in summary.to_text()
    text = _card(tmp_path / "out").text
    assert f"**{note[0].upper()}{note[1:]}.**" in text and "loads in transformers 5 only" in text


def test_remote_code_moe_has_no_fused_experts_note(tmp_path):
    from helpers import build_grok

    plan = prequant.convert(build_grok(tmp_path / "grok", "keyfan", shards=1), tmp_path / "unused", dry_run=True)
    assert plan.fused_experts_note() is None and not any("fuses" in n for n in plan.to_dict()["notes"])


def _named(template, folder, name_or_path: str):
    """A copy of `template` whose config.json's `_name_or_path` is `name_or_path` (what from_pretrained records)."""
    shutil.copytree(template, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "_name_or_path": name_or_path}))
    return folder


@pytest.mark.parametrize("name_or_path, expected", [
    ("my-org/tiny-llama", "my-org/tiny-llama"),  # a repo id
    ("/root/.cache/huggingface/hub/models--my-org--tiny-llama/snapshots/0123abcd", "my-org/tiny-llama"),
    ("./tiny-llama", None),  # local paths, however written
    ("/data/models/tiny-llama", None),
    ("~/tiny-llama", None),
    ("models/llama/tiny", None),
    ("tiny-llama", None),  # no org: a folder name, not a repo id
])
def test_base_model_from_the_configs_name_or_path_only_when_it_is_a_repo(checkpoints, tmp_path, name_or_path,
                                                                          expected):
    src = _named(checkpoints("llama"), tmp_path / "src", name_or_path)
    assert card.base_model_id({"path": str(src)}, src) == expected


def test_a_repo_id_in_the_config_becomes_the_cards_base_model(checkpoints, tmp_path):
    src = _named(checkpoints("llama"), tmp_path / "src", "my-org/tiny-llama")
    summary = prequant.convert(src, tmp_path / "out", device="cpu", progress=False, stats=False)
    got = _card(tmp_path / "out")
    assert got.data.base_model == "my-org/tiny-llama" and got.data.base_model_relation == "quantized"
    assert "[`my-org/tiny-llama`](https://huggingface.co/my-org/tiny-llama)" in got.text
    assert not any("base_model" in note for note in summary.notes)  # nothing to suggest
    assert json.loads((tmp_path / "out" / "prequant.json").read_text())["source"]["base_model"] == "my-org/tiny-llama"


def test_a_local_folder_names_no_base_model_and_the_run_says_how_to_name_it(checkpoints, tmp_path):
    code, stdout, stderr = run_main("convert", str(checkpoints("llama")), str(tmp_path / "cli"), "--device", "cpu",
                                    "--no-stats")
    assert code == 0, stderr
    assert "base_model" not in _card(tmp_path / "cli").data.to_dict()  # not the folder's name: no Hub link
    hint = "the model card names no base_model"
    assert hint not in stderr  # said once, in the summary (the result, on stdout), as the CLI spells it
    assert stdout.count(hint) == 1 and "convert with --base-model org/name" in stdout
    summary = prequant.convert(checkpoints("llama"), tmp_path / "py", device="cpu", progress=False, stats=False)
    assert any(hint in n and "convert with base_model='org/name'" in n for n in summary.notes)  # as Python spells it
    assert json.loads((tmp_path / "py" / "prequant.json").read_text())["source"]["base_model"] is None
