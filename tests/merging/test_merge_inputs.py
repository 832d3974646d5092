"""`prequant merge` given hostile or broken inputs: an adapter is checked as peft checks it before OUTPUT_DIR is
claimed (flags honoured or ignored as peft does, every tensor's shape against its target, config values, an adapter
that changes nothing), a 4-bit base's quant states against their codes, no checkpoint code run without
--trust-remote-code, the job known by its inputs' content, and nothing but the model's own files copied."""

from __future__ import annotations

import json
import os
import shutil
import signal
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from adapters import altered, assert_same_as_peft, make_adapter
from helpers import read_checkpoint, run_cli, run_main

import prequant

Q = "model.layers.{}.self_attn.q_proj"
Q0 = Q.format(0)


def _zero_size(good: Path, out: Path) -> Path:
    """LoRA tensors of rank 0, the config's r kept."""
    empty = {f"{Q.format(i)}.lora_{x}.weight": torch.zeros((0, 64) if x == "A" else (64, 0)) for i in (0, 1)
             for x in "AB"}
    return altered(good, out, tensors=empty)


def _no_tensor_and_no_target(good: Path, out: Path) -> Path:
    from safetensors import safe_open

    with safe_open(good / "adapter_model.safetensors", "pt") as f:
        keys = [k.removeprefix("base_model.model.") for k in f.keys()]
    return altered(good, out, config={"target_modules": ["attn.qkv"]}, tensors=dict.fromkeys(keys))


# name -> (the good adapter's LoraConfig, the broken copy made of it, what the one-line refusal says)
BROKEN: dict[str, tuple[dict, Callable[[Path, Path], Path], tuple[str, ...]]] = {
    "lora_B of another rank": (
        {}, lambda good, out: altered(good, out, tensors={f"{Q0}.lora_B.weight": torch.randn(64, 2)}),
        (f"{Q0}.lora_B.weight", "rank")),
    "lora_A of another input size": (
        {}, lambda good, out: altered(good, out, tensors={f"{Q0}.lora_A.weight": torch.randn(4, 32)}),
        (f"{Q0}.lora_A.weight", "(64, 64)")),
    "r = 0": ({}, lambda good, out: altered(good, out, config={"r": 0}), ("adapter_config.json", "'r'")),
    "LoRA tensors of rank 0": ({}, _zero_size, ("q_proj", "rank 0", "adapter_config.json")),
    "lora_alpha a string": (
        {}, lambda good, out: altered(good, out, config={"lora_alpha": "16"}), ("adapter_config.json", "lora_alpha")),
    "target_parameters a number": (
        {}, lambda good, out: altered(good, out, config={"target_parameters": 5}),
        ("adapter_config.json", "target_parameters")),
    "rank_pattern not a regex": (
        {}, lambda good, out: altered(good, out, config={"rank_pattern": {"q_proj(": 8}}),
        ("adapter_config.json", "rank_pattern", "q_proj(")),
    "use_rslora a string": (
        {}, lambda good, out: altered(good, out, config={"use_rslora": "false"}),
        ("adapter_config.json", "use_rslora")),
    "DoRA magnitude of shape [1]": (
        {"use_dora": True},
        lambda good, out: altered(good, out, tensors={f"{Q0}.lora_magnitude_vector": torch.ones(1)}),
        (f"{Q0}.lora_magnitude_vector", "(64,)")),
    "DoRA magnitude without use_dora": (
        {"use_dora": True}, lambda good, out: altered(good, out, config={"use_dora": False}),
        ("lora_magnitude_vector", "use_dora")),
    "embedding of another vocabulary": (
        {"target_modules": ["embed_tokens"]},
        lambda good, out: altered(good, out, tensors={"model.embed_tokens.lora_embedding_A": torch.randn(4, 255)}),
        ("model.embed_tokens.lora_embedding_A", "(256, 64)")),
    "modules_to_save of another shape": (
        {"modules_to_save": ["lm_head"]},
        lambda good, out: altered(good, out, tensors={"lm_head.weight": torch.randn(255, 64)}),
        ("lm_head.weight", "(256, 64)")),
    "targets the base lacks and no tensor": ({}, _no_tensor_and_no_target, ("changes no tensor", "attn.qkv")),
    "a LoRA variant merged otherwise (QALoRA)": (
        {}, lambda good, out: altered(good, out, config={"use_qalora": True, "qalora_group_size": 16}),
        ("adapter_config.json", "use_qalora", "merge_and_unload")),
    "replicated layers": (
        {}, lambda good, out: altered(good, out, config={"layer_replication": [[0, 2], [1, 2]]}),
        ("adapter_config.json", "layer_replication")),
}


@pytest.mark.parametrize("case", BROKEN)
def test_a_broken_adapter_is_refused_in_one_line_before_output_dir_is_claimed(case, checkpoints, tmp_path):
    lora, breaking, said = BROKEN[case]
    base = checkpoints("llama")
    good = make_adapter(base, tmp_path / "good", **{"target_modules": ["q_proj"], **lora})
    broken = breaking(good, tmp_path / "broken")
    out = tmp_path / "out"
    code, _, err = run_main("merge", str(broken), str(out), "--base", str(base), "--device", "cpu")
    assert code == 1, err
    assert err.startswith("Error: ") and len(err.strip().splitlines()) == 1, err
    assert "unexpected" not in err and all(part in err for part in said), err
    assert not out.exists()
    code, _, err = run_main("merge", str(good), str(out), "--base", str(base), "--device", "cpu")
    assert code == 0, err


@pytest.mark.parametrize("named", [5, ["org/model"]])
def test_a_base_named_by_no_string_is_a_usage_error_naming_the_key(named, checkpoints, tmp_path):
    good = make_adapter(checkpoints("llama"), tmp_path / "good", target_modules=["q_proj"])
    adapter = altered(good, tmp_path / "adapter", config={"base_model_name_or_path": named})
    code, _, err = run_main("merge", str(adapter), str(tmp_path / "out"), "--device", "cpu")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "adapter_config.json" in err and "base_model_name_or_path" in err and "--base" in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("kind", "targets", "says"), [("llama", "all-linear", True),
                                                        ("gpt2", ["c_attn", "c_fc"], False)])
def test_fan_in_fan_out_is_what_the_layer_is_as_peft_takes_it_whatever_the_config_says(kind, targets, says,
                                                                                    checkpoints, tmp_path):
    """peft sets fan_in_fan_out itself from the layer's class, warning when the config says otherwise: False for an
    nn.Linear (Llama), True for a GPT-2 Conv1D."""
    base = checkpoints(kind)
    made = make_adapter(base, tmp_path / "made", target_modules=targets, fan_in_fan_out=not says)
    adapter = altered(made, tmp_path / "adapter", config={"fan_in_fan_out": says})
    prequant.merge(adapter, tmp_path / "out", base=base, device="cpu", progress=False)
    assert_same_as_peft(tmp_path / "out", base, adapter)


def test_a_4bit_base_whose_quant_state_disagrees_with_its_codes_is_refused_naming_the_tensor(checkpoints, tmp_path):
    from safetensors.torch import load_file, save_file

    base = checkpoints("llama")
    converted = tmp_path / "nf4"
    prequant.convert(base, converted, device="cpu", progress=False)
    adapter = make_adapter(base, tmp_path / "adapter", target_modules=["v_proj"])  # q_proj only dequantized
    tensors = load_file(converted / "model.safetensors")
    key = f"{Q0}.weight.quant_state.bitsandbytes__nf4"
    state = json.loads(bytes(tensors[key].tolist()))
    assert state["shape"] == [64, 64]
    state["shape"] = [128, 64]  # the codes hold half of that
    tensors[key] = torch.tensor(list(json.dumps(state).encode()), dtype=torch.uint8)
    save_file(tensors, converted / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "out"
    code, _, err = run_main("merge", str(adapter), str(out), "--base", str(converted), "--device", "cpu")
    assert code == 1 and len(err.strip().splitlines()) == 1, err
    assert f"{Q0}.weight" in err and "[128, 64]" in err, err
    assert not out.exists()


SENTINEL_CONFIG = '''import os
from transformers import LlamaConfig

open(os.environ["SENTINEL"], "a").write("configuration_sentinel.py ran\\n")


class SentinelConfig(LlamaConfig):
    model_type = "sentinel"
'''


@pytest.mark.slow
def test_the_base_s_code_never_runs_without_trust_remote_code_and_nothing_asks(checkpoints, tmp_path):
    """A base whose config names its own code (auto_map, a model_type transformers does not know): an adapter key
    that the checkpoint's names do not match makes the merge ask transformers for the model's names; it must not run
    that code, nor ask on the terminal (here "y" waits on stdin). With --trust-remote-code the code runs."""
    base = tmp_path / "base"
    shutil.copytree(checkpoints("llama"), base)
    (base / "configuration_sentinel.py").write_text(SENTINEL_CONFIG)
    config = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps({**config, "model_type": "sentinel", "auto_map": {
        "AutoConfig": "configuration_sentinel.SentinelConfig"}}))
    good = make_adapter(checkpoints("llama"), tmp_path / "good", target_modules=["q_proj"])
    qkv = "model.layers.0.self_attn.qkv"
    stray = altered(good, tmp_path / "stray", tensors={f"{qkv}.lora_A.weight": torch.randn(4, 64),
                                                       f"{qkv}.lora_B.weight": torch.randn(64, 4)})
    sentinel = tmp_path / "ran"
    env = {"SENTINEL": str(sentinel)}
    refused = run_cli("merge", str(stray), str(tmp_path / "out"), "--base", str(base), "--device", "cpu",
                      input="y\n", env=env)
    assert refused.returncode == 1 and "qkv" in refused.stderr, refused.stderr
    assert "custom code" not in refused.stdout + refused.stderr
    assert not sentinel.exists()
    trusted = run_cli("merge", str(stray), str(tmp_path / "out2"), "--base", str(base), "--device", "cpu",
                      "--trust-remote-code", env=env)
    assert trusted.returncode == 1 and "qkv" in trusted.stderr, trusted.stderr
    assert sentinel.read_text() == "configuration_sentinel.py ran\n"


def test_the_same_merge_typed_another_way_continues_and_then_is_complete(checkpoints, tmp_path):
    base = checkpoints("llama")
    adapter = make_adapter(base, tmp_path / "lora", target_modules=["q_proj", "down_proj"])
    args = ("--base", str(base), "--device", "cpu", "--max-shard-size", "100KB")
    killed = run_cli("merge", "./lora", str(tmp_path / "out"), *args, cwd=tmp_path,
                     env={"PREQUANT_FAILPOINT": "step-journaled:3"})
    assert killed.returncode == -signal.SIGKILL
    resumed = run_cli("merge", str(adapter), str(tmp_path / "out"), *args)
    assert resumed.returncode == 0 and "resuming" in resumed.stderr, resumed.stderr
    os.symlink(adapter, tmp_path / "alias")  # a third spelling: through a link, with a trailing slash
    again = run_cli("merge", "alias/", "out", *args, cwd=tmp_path)
    assert again.returncode == 0 and "already complete" in again.stdout + again.stderr, again.stderr


def test_an_adapter_in_the_base_s_folder_is_not_copied_into_the_merged_model(checkpoints, tmp_path):
    from adapters import TOKENS, logits

    base = tmp_path / "base"
    shutil.copytree(checkpoints("llama"), base)
    make_adapter(base, base, target_modules=["q_proj"])  # peft's files beside the model's
    make_adapter(base, base / "lora", target_modules=["v_proj"])
    prequant.merge(base, tmp_path / "out", base=base, device="cpu", progress=False)
    names = {p.relative_to(tmp_path / "out").as_posix() for p in (tmp_path / "out").rglob("*")}
    assert not {n for n in names if "adapter" in n or n.startswith("lora")}, names
    assert {"tokenizer_config.json", "LICENSE"} <= names
    assert logits(tmp_path / "out", TOKENS).isfinite().all()
    assert read_checkpoint(tmp_path / "out").keys() == read_checkpoint(checkpoints("llama")).keys()


def test_an_interrupted_merge_of_another_adapter_is_refused_saying_the_adapter_changed(checkpoints, tmp_path):
    base = checkpoints("llama")
    adapter = make_adapter(base, tmp_path / "lora", target_modules=["q_proj", "down_proj"])
    args = ("--base", str(base), "--device", "cpu", "--max-shard-size", "100KB")
    killed = run_cli("merge", str(adapter), str(tmp_path / "out"), *args,
                     env={"PREQUANT_FAILPOINT": "step-journaled:3"})
    assert killed.returncode == -signal.SIGKILL
    other = altered(adapter, tmp_path / "other", config={"lora_alpha": 16})
    code, _, err = run_main("merge", str(other), str(tmp_path / "out"), *args)
    assert code == 2 and "the adapter's files changed" in err and "--overwrite" in err, err
