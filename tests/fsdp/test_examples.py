"""README's training section on a fresh checkout, on the CPU: the demo checkpoint (scripts/make_tiny_checkpoint.py,
with its tokenizer), converted by `prequant convert --device cpu`, trained for a few steps by each example script
under torchrun on 2 gloo ranks on the shipped conversations (scripts/data/chats.jsonl); the adapter reloads."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from prequant.fsdp.loader import LAUNCHER_ENV

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts"


def _run(*args: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
                          check=False)


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> Path:
    """README's demo: `make_tiny_checkpoint.py demo/tiny-llama`, then `prequant convert ... --device cpu`."""
    work = tmp_path_factory.mktemp("readme")
    made = _run(str(SCRIPTS / "make_tiny_checkpoint.py"), "demo/tiny-llama", cwd=work)
    assert made.returncode == 0, made.stderr[-3000:]
    converted = _run("-m", "prequant", "convert", "demo/tiny-llama", "demo/tiny-llama-nf4", "--device", "cpu", cwd=work)
    assert converted.returncode == 0, converted.stderr[-3000:]
    return work


@pytest.mark.slow
def test_demo_checkpoint_carries_a_tokenizer_with_a_chat_template_and_the_models_vocabulary(demo):
    from transformers import AutoConfig, AutoTokenizer

    ckpt = demo / "demo" / "tiny-llama-nf4"  # the converted one: prequant carries the tokenizer over
    tokenizer = AutoTokenizer.from_pretrained(ckpt)
    config = AutoConfig.from_pretrained(ckpt)
    assert len(tokenizer) == config.vocab_size and tokenizer.pad_token_id == config.pad_token_id
    chat = [{"role": "user", "content": "What is 2 + 4?"}, {"role": "assistant", "content": "6."}]
    text = tokenizer.apply_chat_template(chat, tokenize=False)
    assert text == "<|user|>\nWhat is 2 + 4?</s>\n<|assistant|>\n6.</s>\n"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text and tokenizer.eos_token_id in ids and max(ids) < config.vocab_size
    assert tokenizer.unk_token_id is None  # byte-level: every text encodes


def _trained_adapter(demo: Path, adapter: Path) -> None:
    """The adapter reloads with peft on the base checkpoint (unsharded), and training moved LoRA B off zero."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(demo / "demo" / "tiny-llama-nf4", dtype=torch.bfloat16)
    model = PeftModel.from_pretrained(base, adapter)
    b = [p for n, p in model.named_parameters() if ".lora_B." in n]
    assert len(b) == 28 and any(p.abs().sum() > 0 for p in b)


@pytest.mark.slow
def test_sft_trainer_example_trains_on_two_gloo_ranks_and_saves_an_adapter_that_reloads(demo):
    proc = _run("-m", "torch.distributed.run", "--nproc_per_node", "2", str(SCRIPTS / "sft_trl.py"),
                "demo/tiny-llama-nf4", "--steps", "2", "--max-seq-length", "64", "--save-steps", "0",
                "--output", "sft-lora", cwd=demo)
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert "saved the LoRA adapter to sft-lora" in proc.stdout + proc.stderr
    _trained_adapter(demo, demo / "sft-lora")


@pytest.mark.slow
def test_plain_loop_example_trains_on_two_gloo_ranks_and_saves_an_adapter_that_reloads(demo):
    proc = _run("-m", "torch.distributed.run", "--nproc_per_node", "2", str(SCRIPTS / "train_qlora_fsdp.py"),
                "demo/tiny-llama-nf4", "--steps", "2", "--seq-len", "64", "--output", "plain-lora", cwd=demo)
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert "step 2/2 loss" in proc.stderr and "saved the LoRA adapter to plain-lora" in proc.stderr
    _trained_adapter(demo, demo / "plain-lora")


@pytest.mark.parametrize("script", ["sft_trl.py", "train_qlora_fsdp.py"])
def test_examples_started_without_a_launcher_say_what_to_run_in_one_line(script, tmp_path):
    proc = _run(str(SCRIPTS / script), "demo/tiny-llama-nf4", "--steps", "2", cwd=tmp_path)
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"Error: {SCRIPTS / script} runs on every rank of a launcher; run: "
                                                   f"torchrun --nproc_per_node 2 {SCRIPTS / script} demo/tiny-llama-nf4 "
                                                   "--steps 2"), proc.stderr


def _python_block(page: Path, marker: str) -> str:
    """The ```python block of `page` that holds `marker`."""
    blocks = page.read_text().split("```python\n")[1:]
    return next(b.split("```", 1)[0] for b in blocks if marker in b)


# What the snippets leave to the reader's script: its data and tokenizer (the demo's), and a run of one step.
_PROLOGUE = """\
from datasets import load_dataset
from transformers import AutoTokenizer

tokenizer = AutoTokenizer.from_pretrained("demo/tiny-llama-nf4")
dataset = load_dataset("json", data_files={chats!r}, split="train")
"""


@pytest.mark.slow
@pytest.mark.parametrize("page", ["README.md", "docs/fsdp.md"])
def test_the_sft_trainer_snippet_runs_on_the_cpu(demo, page):
    """README invites users to try training on the CPU first: its SFTTrainer snippet (and docs/fsdp.md's), on the
    demo checkpoint, run as written (a step instead of 500) under torchrun on 2 gloo ranks."""
    snippet = _python_block(ROOT / page, "SFTConfig(")
    assert '"llama3-8b-nf4"' in snippet and "max_steps=500" in snippet
    script = _PROLOGUE.format(chats=str(SCRIPTS / "data" / "chats.jsonl")) + snippet.replace(
        '"llama3-8b-nf4"', '"demo/tiny-llama-nf4"').replace("max_steps=500", "max_steps=1")
    (demo / "snippet.py").write_text(script)
    shutil.rmtree(demo / "lora", ignore_errors=True)  # the other page's
    proc = _run("-m", "torch.distributed.run", "--nproc_per_node", "2", "snippet.py", cwd=demo)
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert (demo / "lora" / "adapter_model.safetensors").is_file()
    _trained_adapter(demo, demo / "lora")
