"""The output's model card (README.md): metadata, the original card and its licence carried, how to load it."""

from __future__ import annotations

import json
import shutil

from huggingface_hub import ModelCard

import prequant


def test_card_metadata_and_original_card(carded_converted):
    card = ModelCard.load(carded_converted / "README.md")
    data = card.data.to_dict()
    assert data["base_model"] == "tiny-llama" and data["base_model_relation"] == "quantized"
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
        "- 16,384 parameters: skipped (output embedding / tied / last module)\n"
        "- 16,704 parameters: not a linear weight\n\n"
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
    assert ModelCard.load(tmp_path / "b" / "README.md").data.base_model == "src"
