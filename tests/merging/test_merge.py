"""`prequant merge` on tiny models, one adapter flavour per test (peft builds each adapter, every trained tensor
random): the merged bytes equal peft's merge_and_unload (or the stated rule where peft rounds twice), and the merged
model's logits equal PeftModel(base, adapter)'s within bf16 rounding. Into a 4-bit base: W is bitsandbytes'
dequantization, the logits are the adapted 4-bit model's, and `--quantize` quantizes each merged tensor as a
conversion of the 16-bit merge would."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from adapters import TOKENS, altered, assert_logits_close, assert_same_as_peft, logits, make_adapter, peft_logits, peft_merged
from helpers import read_checkpoint, run_cli, run_main

import prequant
from prequant.errors import PrequantError, UsageError


FLAVOURS = {
    "lora": {"target_modules": "all-linear"},
    "rslora": {"target_modules": ["q_proj", "v_proj"], "use_rslora": True},
    "patterns": {"target_modules": "all-linear", "rank_pattern": {"down_proj": 8},
                 "alpha_pattern": {"layers.1.self_attn.q_proj": 3}},
    "modules_to_save": {"target_modules": ["q_proj"], "modules_to_save": ["lm_head"]},
    "dora": {"target_modules": ["q_proj", "down_proj"], "use_dora": True},
}


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_merge_into_a_16bit_base_equals_peft_merge_and_unload(flavour, checkpoints, tmp_path):
    base = checkpoints("llama")
    adapter = make_adapter(base, tmp_path / "adapter", **FLAVOURS[flavour])
    summary = prequant.merge(adapter, tmp_path / "out", base=base, device="cpu", progress=False)
    ours = assert_same_as_peft(tmp_path / "out", base, adapter)
    source = read_checkpoint(base)
    changed = {k for k in ours if not torch.equal(ours[k], source[k])}
    assert changed and summary.tensors_quantized == 0
    manifest = json.loads((tmp_path / "out" / "prequant.json").read_text())
    assert set(manifest["merge"]["targets"]) == changed
    assert manifest["adapter"]["sha256"]["adapter_config.json"]


def test_gpt2_conv1d_fan_in_fan_out_and_dora_equal_peft(checkpoints, tmp_path):
    base = checkpoints("gpt2")  # float32 Conv1D weights stored [in, out]
    for name, extra in (("lora", {}), ("dora", {"use_dora": True})):
        adapter = make_adapter(base, tmp_path / name, target_modules=["c_attn", "c_fc"], fan_in_fan_out=True, **extra)
        prequant.merge(adapter, tmp_path / f"out-{name}", base=base, device="cpu", progress=False)
        assert_same_as_peft(tmp_path / f"out-{name}", base, adapter)


def test_embedding_lora_follows_the_rule_where_peft_rounds_the_delta_first(checkpoints, tmp_path):
    from safetensors.torch import load_file

    base = checkpoints("llama")
    adapter = make_adapter(base, tmp_path / "adapter", target_modules=["embed_tokens", "q_proj"])
    prequant.merge(adapter, tmp_path / "out", base=base, device="cpu", progress=False)
    ours, ref = read_checkpoint(tmp_path / "out"), peft_merged(base, adapter)
    lora = load_file(adapter / "adapter_model.safetensors")
    key = "model.embed_tokens.weight"
    a, b = (lora[f"base_model.model.model.embed_tokens.lora_embedding_{x}"] for x in "AB")
    w, delta = read_checkpoint(base)[key], (b @ a).T * 2.0
    assert torch.equal(ours[key], (w.float() + delta).to(torch.bfloat16))
    # peft adds the delta rounded to bf16 first: apart by at most a bf16 step of the result and one of the delta
    step = (ours[key].float().abs() + delta.abs()) * 2**-7 + 2**-133
    assert ((ours[key].float() - ref[key].float()).abs() <= step).all() and not torch.equal(ours[key], ref[key])
    assert all(torch.equal(ours[k], ref[k]) for k in ours if k != key)
    assert_logits_close(logits(tmp_path / "out", TOKENS), peft_logits(base, adapter, TOKENS))


def _dequantized(four_bit: Path) -> dict[str, torch.Tensor]:
    """Every 4-bit weight of `four_bit` as bitsandbytes dequantizes it (its CPU path: right for these shapes, whose
    rows are whole blocks)."""
    from bitsandbytes.functional import QuantState, dequantize_4bit

    tensors = read_checkpoint(four_bit)
    out = {}
    for key in [k.split(".quant_state.")[0] for k in tensors if ".quant_state." in k]:
        parts = {k.removeprefix(key + "."): v for k, v in tensors.items() if k.startswith(key + ".")}
        state = QuantState.from_dict(parts, torch.device("cpu"))
        out[key] = dequantize_4bit(tensors[key].view(torch.uint8).view(-1, 1), state)
    return out


@pytest.fixture(scope="module")
def four_bit(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(16-bit base, its 4-bit conversion, an adapter on q_proj and down_proj)."""
    from helpers import build_checkpoint

    root = tmp_path_factory.mktemp("four-bit")
    base = build_checkpoint("llama", root / "base")
    converted = root / "nf4"
    prequant.convert(base, converted, device="cpu", progress=False)
    return base, converted, make_adapter(base, root / "adapter", target_modules=["q_proj", "down_proj"])


def test_merge_into_a_4bit_base_merges_into_bitsandbytes_dequantized_weights(four_bit, tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from prequant.verify.run import verify

    base, converted, adapter = four_bit
    prequant.merge(adapter, tmp_path / "out", base=converted, device="cpu", progress=False)
    ours, dequantized = read_checkpoint(tmp_path / "out"), _dequantized(converted)
    assert set(ours) == set(read_checkpoint(base))
    assert "quantization_config" not in json.loads((tmp_path / "out" / "config.json").read_text())
    lora = load_file(adapter / "adapter_model.safetensors")
    for key, w in dequantized.items():
        module = key.removesuffix(".weight")
        if f"base_model.model.{module}.lora_A.weight" in lora:
            a, b = (lora[f"base_model.model.{module}.lora_{x}.weight"] for x in "AB")
            w = (w.float() + (b @ a) * 2.0).to(torch.bfloat16)
        assert torch.equal(ours[key], w), key
    model = AutoModelForCausalLM.from_pretrained(converted, device_map="cpu")
    adapted = PeftModel.from_pretrained(model, adapter).eval()
    with torch.no_grad():
        reference = adapted(TOKENS).logits.float()
    assert_logits_close(logits(tmp_path / "out", TOKENS), reference)
    assert verify(tmp_path / "out", progress=False).ok


def test_quantize_writes_what_converting_the_16bit_merge_writes_and_copies_the_rest(four_bit, tmp_path):
    from prequant.verify.run import verify

    _, converted, adapter = four_bit
    prequant.merge(adapter, tmp_path / "merged16", base=converted, device="cpu", progress=False)
    prequant.convert(tmp_path / "merged16", tmp_path / "reference", device="cpu", progress=False)
    prequant.merge(adapter, tmp_path / "out", base=converted, device="cpu", progress=False, quantize=True)
    ours, reference, stored = (read_checkpoint(p) for p in (tmp_path / "out", tmp_path / "reference", converted))
    assert set(ours) == set(stored)
    merged = {k for k in ours if ".q_proj.weight" in k or ".down_proj.weight" in k}
    for key in ours:
        expected = reference[key] if key in merged else stored[key]
        assert ours[key].dtype == expected.dtype and torch.equal(ours[key].view(torch.uint8),
                                                                  expected.view(torch.uint8)), key
    assert json.loads((tmp_path / "out" / "config.json").read_text()) == json.loads((converted / "config.json").read_text())
    assert verify(tmp_path / "out", progress=False).ok


def test_experts_adapter_in_transformers_5_names_merges_into_the_4bit_experts(tmp_path):
    """An adapter on every expert as load_for_fsdp trains it (prequant.load_model's per-expert linears, the
    model's names: transformers 5 calls Mixtral's block_sparse_moe `mlp`), into the --quantize-experts base."""
    from moe_checkpoints import build_moe
    from peft import LoraConfig, PeftModel, get_peft_model

    from prequant.fsdp.experts import lora_targets_as_named

    converted = tmp_path / "ckpt"
    prequant.convert(build_moe("mixtral", tmp_path / "src"), converted, device="cpu", progress=False,
                     quantize_experts=True)
    model = prequant.load_model(converted)
    with lora_targets_as_named(model):
        peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                      init_lora_weights=False))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.05)
    peft_model.save_pretrained(tmp_path / "adapter")
    keys = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert keys["peft_type"] == "LORA"
    prequant.merge(tmp_path / "adapter", tmp_path / "out", base=converted, device="cpu", progress=False)
    merged = json.loads((tmp_path / "out" / "prequant.json").read_text())["merge"]["targets"]
    assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in merged
    with lora_targets_as_named(model := prequant.load_model(converted)):
        adapted = PeftModel.from_pretrained(model, tmp_path / "adapter").eval()
    with torch.no_grad():
        reference = adapted(TOKENS).logits.float()
    assert_logits_close(logits(tmp_path / "out", TOKENS), reference)
    # The same adapter in transformers 4's names (the checkpoint's own): the same merge.
    from safetensors.torch import load_file, save_file

    tf4 = tmp_path / "adapter-tf4"
    shutil.copytree(tmp_path / "adapter", tf4)
    tensors = load_file(tf4 / "adapter_model.safetensors")
    save_file({k.replace(".mlp.", ".block_sparse_moe."): v for k, v in tensors.items()}, tf4 / "adapter_model.safetensors")
    prequant.merge(tf4, tmp_path / "out-tf4", base=converted, device="cpu", progress=False)
    assert (tmp_path / "out-tf4" / "model.safetensors").read_bytes() == (tmp_path / "out" / "model.safetensors").read_bytes()


def test_rerun_is_complete_and_the_cli_merges_with_an_honest_exit(checkpoints, tmp_path):
    base = checkpoints("llama")
    adapter = make_adapter(base, tmp_path / "adapter", target_modules=["q_proj"])
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": str(base)}))
    done = run_cli("merge", str(adapter), str(tmp_path / "out"), "--device", "cpu")
    assert done.returncode == 0, done.stderr
    assert "merged: 2 tensors changed" in done.stdout
    again = prequant.merge(adapter, tmp_path / "out", device="cpu", progress=False)
    assert again.already_complete
    missing = run_cli("merge", str(tmp_path / "nothing"), str(tmp_path / "out2"))
    assert missing.returncode == 1 and "ADAPTER" in missing.stderr and len(missing.stderr.strip().splitlines()) == 1


def test_a_finished_merge_run_again_with_another_skip_names_skip(checkpoints, tmp_path):
    base = checkpoints("llama")
    adapter = make_adapter(base, tmp_path / "adapter", target_modules=["q_proj"])
    args = ("merge", str(adapter), str(tmp_path / "out"), "--base", str(base), "--device", "cpu", "--quantize")
    code, _, err = run_main(*args)
    assert code == 0, err
    code, _, err = run_main(*args, "--skip", "o_proj")
    assert code == 2, err
    assert "holds a finished conversion with other options (--skip: [] there, ['o_proj'] here)" in err, err


def test_a_finished_merge_run_again_with_another_adapter_says_the_adapter_differs(checkpoints, tmp_path):
    base = checkpoints("llama")
    first = make_adapter(base, tmp_path / "first", target_modules=["q_proj"])
    second = altered(first, tmp_path / "second", config={"lora_alpha": 16})
    prequant.merge(first, tmp_path / "out", base=base, device="cpu", progress=False)
    with pytest.raises(UsageError, match="holds a finished conversion of another adapter") as refused:
        prequant.merge(second, tmp_path / "out", base=base, device="cpu", progress=False)
    assert "another source" not in str(refused.value) and "overwrite=True" in str(refused.value)


@pytest.mark.parametrize("kind", ["LOHA", "VERA"])
def test_other_peft_types_are_refused_naming_them(kind, checkpoints, tmp_path):
    base = checkpoints("llama")
    adapter = make_adapter(base, tmp_path / "adapter", target_modules=["q_proj"])
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "peft_type": kind}))
    with pytest.raises(PrequantError, match=f"peft_type '{kind}' is not LoRA"):
        prequant.merge(adapter, tmp_path / "out", base=base, device="cpu", progress=False)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_loha_keys_and_unmatched_keys_are_refused_naming_the_key(checkpoints, tmp_path):
    from safetensors.torch import load_file, save_file

    base = checkpoints("llama")
    adapter = make_adapter(base, tmp_path / "adapter", target_modules=["q_proj"])
    tensors = load_file(adapter / "adapter_model.safetensors")
    for extra, message in (("base_model.model.model.layers.0.self_attn.q_proj.hada_w1_a", "hada_w1_a"),
                           ("base_model.model.model.layers.9.self_attn.q_proj.lora_A.weight",
                            "matches no tensor of the base model")):
        broken = tmp_path / extra.split(".")[-2]
        shutil.copytree(adapter, broken)
        save_file({**tensors, extra: torch.zeros(4, 64)}, broken / "adapter_model.safetensors")
        with pytest.raises(PrequantError, match=message) as e:
            prequant.merge(broken, tmp_path / f"out-{broken.name}", base=base, device="cpu", progress=False)
        assert extra in str(e.value) and "\n" not in str(e.value)


def test_adapter_from_the_hub(hub_server, checkpoints, tmp_path):
    base = checkpoints("llama")
    adapter = make_adapter(base, tmp_path / "adapter", target_modules=["v_proj"])
    sha = hub_server.add_repo("org/lora", {p.name: p for p in adapter.iterdir() if p.is_file()})
    prequant.merge("org/lora", tmp_path / "out", base=base, device="cpu", progress=False)
    assert_same_as_peft(tmp_path / "out", base, adapter)
    recorded = json.loads((tmp_path / "out" / "prequant.json").read_text())["adapter"]
    assert recorded["repo_id"] == "org/lora" and recorded["commit"] == sha
    assert "org/lora" in (tmp_path / "out" / "README.md").read_text()



def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.mark.slow
def test_killed_merge_continues_to_the_same_files_and_a_changed_adapter_is_another_job(four_bit, tmp_path):
    import signal

    _, converted, adapter = four_bit
    args = ("--base", str(converted), "--device", "cpu", "--max-shard-size", "100KB")
    assert run_cli("merge", str(adapter), str(tmp_path / "clean"), *args).returncode == 0
    killed = run_cli("merge", str(adapter), str(tmp_path / "out"), *args, env={"PREQUANT_FAILPOINT": "step-journaled:5"})
    assert killed.returncode == -signal.SIGKILL
    resumed = run_cli("merge", str(adapter), str(tmp_path / "out"), *args)
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming" in resumed.stderr
    clean, out = _files(tmp_path / "clean"), _files(tmp_path / "out")
    assert len([n for n in clean if n.endswith(".safetensors")]) > 1
    assert {n: b for n, b in out.items() if n != "prequant.json"} == {n: b for n, b in clean.items() if n != "prequant.json"}
    other = tmp_path / "other-adapter"
    shutil.copytree(adapter, other)
    config = json.loads((other / "adapter_config.json").read_text())
    (other / "adapter_config.json").write_text(json.dumps({**config, "lora_alpha": 16}))
    refused = run_cli("merge", str(other), str(tmp_path / "out"), *args)
    assert refused.returncode != 0 and "--overwrite" in refused.stderr


def test_merge_push_to_hub_uploads_the_verified_output(hub_server, checkpoints, tmp_path, monkeypatch):
    from hub_server import TOKEN

    monkeypatch.setenv("HF_TOKEN", TOKEN)
    base = checkpoints("llama")
    adapter = make_adapter(base, tmp_path / "adapter", target_modules=["q_proj"])
    summary = prequant.merge(adapter, tmp_path / "out", base=base, device="cpu", progress=False,
                             push_to_hub="me/merged")
    assert summary.hub_commit_url.endswith(hub_server.head("me/merged"))
    uploaded = hub_server.files("me/merged")
    assert uploaded["prequant.json"] == (tmp_path / "out" / "prequant.json").read_bytes()
    assert uploaded["model.safetensors"] == (tmp_path / "out" / "model.safetensors").read_bytes()


@pytest.mark.parametrize("fmt", ["block", "channel"])
def test_merge_into_an_fp8_base_equals_the_merge_into_its_16bit_reference(fmt, tmp_path):
    from fp8_checkpoints import fp8_pair

    fp8, reference = fp8_pair(tmp_path, fmt, torch.float32)
    adapter = make_adapter(reference, tmp_path / "adapter", target_modules=["q_proj", "o_proj"])
    prequant.merge(adapter, tmp_path / "from-fp8", base=fp8, device="cpu", progress=False)
    prequant.merge(adapter, tmp_path / "from-ref", base=reference, device="cpu", progress=False)
    ours, expected = read_checkpoint(tmp_path / "from-fp8"), read_checkpoint(tmp_path / "from-ref")
    assert set(ours) == set(expected) and all(torch.equal(ours[k], expected[k]) for k in ours)
    assert "quantization_config" not in json.loads((tmp_path / "from-fp8" / "config.json").read_text())


def test_a_4bit_base_on_the_hub(hub_server, four_bit, tmp_path):
    _, converted, adapter = four_bit
    hub_server.add_repo("org/tiny-nf4", {p.name: p for p in converted.iterdir() if p.is_file()})
    prequant.merge(adapter, tmp_path / "hub", base="org/tiny-nf4", device="cpu", progress=False)
    prequant.merge(adapter, tmp_path / "local", base=converted, device="cpu", progress=False)
    assert read_checkpoint(tmp_path / "hub").keys() == read_checkpoint(tmp_path / "local").keys()
    assert (tmp_path / "hub" / "model.safetensors").read_bytes() == (tmp_path / "local" / "model.safetensors").read_bytes()


def test_quantize_into_a_16bit_base_writes_what_converting_the_16bit_merge_writes(checkpoints, tmp_path):
    base = checkpoints("llama")
    adapter = make_adapter(base, tmp_path / "adapter", target_modules=["q_proj", "gate_proj"])
    prequant.merge(adapter, tmp_path / "merged16", base=base, device="cpu", progress=False)
    prequant.convert(tmp_path / "merged16", tmp_path / "reference", device="cpu", progress=False, quant_type="fp4")
    summary = prequant.merge(adapter, tmp_path / "out", base=base, device="cpu", progress=False, quantize=True,
                             quant_type="fp4")
    assert summary.tensors_quantized > 0
    for name in ("model.safetensors", "config.json"):
        assert (tmp_path / "out" / name).read_bytes() == (tmp_path / "reference" / name).read_bytes()


def test_gpt2_4bit_base_merges_in_the_stored_conv1d_layout(converted_gpt2, tmp_path):
    """The 4-bit base holds each Conv1D weight quantized as its [out, in] transpose: dequantized, it goes back to the
    [in, out] layout a 16-bit GPT-2 stores, where the fan_in_fan_out adapter applies; --quantize transposes it again."""
    base, converted = converted_gpt2
    adapter = make_adapter(base, tmp_path / "adapter", target_modules=["c_attn"], fan_in_fan_out=True)
    prequant.merge(adapter, tmp_path / "merged16", base=converted, device="cpu", progress=False)
    ours, source, dequantized = read_checkpoint(tmp_path / "merged16"), read_checkpoint(base), _dequantized(converted)
    assert {k: v.shape for k, v in ours.items()} == {k: v.shape for k, v in source.items()}
    w = dequantized["transformer.h.0.attn.c_attn.weight"].T
    from safetensors.torch import load_file

    lora = load_file(adapter / "adapter_model.safetensors")
    a, b = (lora[f"base_model.model.transformer.h.0.attn.c_attn.lora_{x}.weight"] for x in "AB")
    assert torch.equal(ours["transformer.h.0.attn.c_attn.weight"], (w.float() + (b @ a).T * 2.0).to(w.dtype))
    assert torch.equal(ours["transformer.h.0.mlp.c_fc.weight"], dequantized["transformer.h.0.mlp.c_fc.weight"].T)
    prequant.convert(tmp_path / "merged16", tmp_path / "reference", device="cpu", progress=False)
    prequant.merge(adapter, tmp_path / "out", base=converted, device="cpu", progress=False, quantize=True)
    quantized, reference, stored = (read_checkpoint(p) for p in (tmp_path / "out", tmp_path / "reference", converted))
    assert set(quantized) == set(stored)
    for key, value in quantized.items():
        expected = reference[key] if ".c_attn.weight" in key else stored[key]
        assert torch.equal(value.view(torch.uint8), expected.view(torch.uint8)), key


@pytest.mark.slow
def test_a_merge_into_a_4bit_base_reports_real_parameters_shapes_and_actions(four_bit, tmp_path):
    """The report of a merge into a 4-bit base counts the parameters a 16-bit base's report counts (not packed
    elements), shows the weights' real shapes, says "merge" for a merged tensor, and a 16-bit output's plan names no
    4-bit settings."""
    base, converted, adapter = four_bit
    args = ("merge", str(adapter), str(tmp_path / "out"), "--device", "cpu")
    on_16 = run_cli(*args, "--base", str(base), "--dry-run", "--json")
    on_4 = run_cli(*args, "--base", str(converted), "--dry-run", "--json")
    assert on_16.returncode == 0 and on_4.returncode == 0, on_16.stderr + on_4.stderr
    plan_16, plan_4 = json.loads(on_16.stdout), json.loads(on_4.stdout)
    assert (sum(plan_4["unquantized_parameters"].values()) == sum(plan_16["unquantized_parameters"].values())
            == sum(t.numel() for t in read_checkpoint(base).values()))
    assert plan_4["unquantized_parameters"]["merged with the adapter"] == \
        plan_16["unquantized_parameters"]["merged with the adapter"]
    shapes_16 = {t["name"]: t["shape"] for t in plan_16["tensors"]}
    assert {t["name"]: t["shape"] for t in plan_4["tensors"]} == shapes_16
    q_proj = "model.layers.0.self_attn.q_proj.weight"
    actions = {t["name"]: t["action"] for plan in (plan_16, plan_4) for t in plan["tensors"] if t["name"] == q_proj}
    assert actions == {q_proj: "merge"}
    text = run_cli(*args, "--base", str(converted), "--dry-run")
    assert text.returncode == 0, text.stderr
    header, *rows = text.stdout.splitlines()
    assert header.startswith("plan: 16-bit, nothing quantized;") and "nf4" not in header
    row = next(r.split() for r in rows if q_proj in r)
    assert row[0] == "merge" and row[3] == "64x64"
    # No 4-bit settings for a 16-bit output; tensors counted by what becomes of them, in the plan and the summary.
    merged_count = sum(t["action"] == "merge" for t in plan_16["tensors"])
    for plan in (plan_16, plan_4):
        assert plan["settings"] is None and plan["quantized_tensors"] == 0
        assert plan["other_tensors"]["merged"] == merged_count > 0
        assert plan["kept_tensors"] + sum(plan["other_tensors"].values()) == len(plan["tensors"])
    assert plan_4["other_tensors"]["dequantized"] == sum(t["action"] == "dequantize" for t in plan_4["tensors"]) > 0
    done = run_cli(*args, "--base", str(converted))
    assert done.returncode == 0, done.stderr
    merged = next(line for line in done.stdout.splitlines() if "merged with the adapter" in line)
    assert f"{plan_16['unquantized_parameters']['merged with the adapter']:,} parameters" in merged
    first = done.stdout.splitlines()[0]
    assert (f"0 tensors quantized, {plan_4['kept_tensors']} kept, {merged_count} merged, "
            f"{plan_4['other_tensors']['dequantized']} dequantized, 1 shard(s)") in first, first
    summary = json.loads(run_cli(*args, "--base", str(base), "--json", "--overwrite").stdout)
    assert summary["tensors_other"] == {"merged": merged_count}
    assert summary["tensors_kept"] == plan_16["kept_tensors"] and summary["tensors_quantized"] == 0


def test_merge_quantize_takes_convert_s_4bit_options_on_the_command_line(checkpoints, tmp_path):
    """--quant-type (any case), --blocksize, --quant-storage, --skip and --no-stats: the same output as Python's
    keywords."""
    base = checkpoints("llama")
    adapter = make_adapter(base, tmp_path / "adapter", target_modules=["q_proj", "o_proj"])
    proc = run_cli("merge", str(adapter), str(tmp_path / "cli"), "--base", str(base), "--device", "cpu", "--quantize",
                   "--quant-type", "FP4", "--blocksize", "128", "--quant-storage", "uint8", "--skip", "o_proj",
                   "--no-stats")
    assert proc.returncode == 0, proc.stderr
    prequant.merge(adapter, tmp_path / "py", base=base, quantize=True, device="cpu", progress=False, quant_type="fp4",
                   blocksize=128, quant_storage="uint8", skip=["o_proj"], stats=False)
    for name in ("model.safetensors", "config.json"):
        assert (tmp_path / "cli" / name).read_bytes() == (tmp_path / "py" / name).read_bytes(), name
    qc = json.loads((tmp_path / "cli" / "config.json").read_text())["quantization_config"]
    assert (qc["bnb_4bit_quant_type"], qc["bnb_4bit_quant_storage"]) == ("fp4", "uint8")
    assert "o_proj" in qc["llm_int8_skip_modules"]
    manifest = json.loads((tmp_path / "cli" / "prequant.json").read_text())
    assert manifest["options"]["blocksize"] == 128 and manifest["stats"]["enabled"] is False


def test_4bit_options_a_merge_would_ignore_are_refused(four_bit, tmp_path):
    base, converted, adapter = four_bit
    args = ("merge", str(adapter), str(tmp_path / "out"), "--device", "cpu", "--dry-run")
    sixteen = run_cli(*args, "--base", str(base), "--quant-type", "fp4")
    assert sixteen.returncode == 2
    assert "--quant-type fp4 applies to a 4-bit output only; add --quantize" in sixteen.stderr
    into_4bit = run_cli(*args, "--base", str(converted), "--quantize", "--blocksize", "128")
    assert into_4bit.returncode == 2, into_4bit.stderr
    assert "--blocksize 128: a merge into a 4-bit base quantizes the merged weights again with the base's own" \
        in into_4bit.stderr
    same = run_cli(*args, "--base", str(converted), "--quantize", "--quant-type", "NF4")  # the base's own: fine
    assert same.returncode == 0, same.stderr
