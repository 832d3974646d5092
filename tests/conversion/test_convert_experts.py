"""`--quantize-experts` end to end on tiny checkpoints of each MoE architecture: the bytes, the skip list, the record,
the card and summary, `prequant.load_model`'s logits against a reference with the dequantized weights, verify."""

from __future__ import annotations

import json
import re

import pytest
import torch
import transformers
from helpers import gpu_only
from moe_checkpoints import HANDLED, REFUSED, build_moe, dequantized_reference, entries_of, logits_of, read_all

import prequant
from prequant.bnb.experts import expert_match
from prequant.bnb.moe import TRANSFORMERS_TESTED
from prequant.bnb.quantize import quantize_tensor
from prequant.errors import PrequantError

# load_model refuses a transformers older than the one its expert modules follow; the GPU machine's image may have one
needs_tested_transformers = pytest.mark.skipif(
    tuple(int(p) for p in transformers.__version__.split(".")[:2]) < TRANSFORMERS_TESTED,
    reason="prequant.load_model needs transformers 5.25 or later (carry its wheel to the GPU machine)")


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """kind -> (source, output converted with --quantize-experts), built once per module."""
    cache = {}

    def get(kind: str):
        if kind not in cache:
            root = tmp_path_factory.mktemp(kind)
            src = build_moe(kind, root / "src")
            prequant.convert(src, root / "out", device="cpu", progress=False, quantize_experts=True)
            cache[kind] = (src, root / "out")
        return cache[kind]

    return get


@pytest.mark.parametrize("kind", HANDLED)
def test_every_expert_weight_is_4bit_with_the_cpu_kernels_bytes(made, kind):
    src, out = made(kind)
    source, output = read_all(src), read_all(out)
    experts = [k for k in source if expert_match(k)]
    assert experts and all(k.rsplit(".", 2)[-2] in ("gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")
                           for k in experts)
    for key in experts:
        want = quantize_tensor(source[key], quant_storage=torch.bfloat16, name=key)
        got = entries_of(output, key)
        assert set(got) == set(want), key
        for entry, value in want.items():
            assert got[entry].dtype == value.dtype and torch.equal(got[entry].view(torch.uint8),
                                                                   value.view(torch.uint8)), (key, entry)


def test_the_run_s_settings_apply_to_experts(tmp_path):
    src = build_moe("qwen3_moe", tmp_path / "src")
    prequant.convert(src, tmp_path / "out", device="cpu", progress=False, quantize_experts=True, quant_type="fp4",
                     double_quant=False, blocksize=128, quant_storage="uint8")
    source, output = read_all(src), read_all(tmp_path / "out")
    key = "model.layers.1.mlp.experts.3.down_proj.weight"
    want = quantize_tensor(source[key], quant_type="fp4", double_quant=False, blocksize=128, name=key)
    got = entries_of(output, key)
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("kind", HANDLED)
def test_routers_stay_unquantized_and_in_the_skip_list(made, kind):
    src, out = made(kind)
    source, output = read_all(src), read_all(out)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    routers = sorted({k.removesuffix(".weight") for k in source if re.search(r"\.gate\.weight$", k)})
    assert routers and set(routers) <= set(qc["llm_int8_skip_modules"]) and "lm_head" in qc["llm_int8_skip_modules"]
    for r in routers:
        assert torch.equal(output[f"{r}.weight"], source[f"{r}.weight"]) and f"{r}.weight.absmax" not in output


@pytest.mark.parametrize("kind", REFUSED)
def test_other_expert_layouts_are_refused_in_one_line(tmp_path, kind):
    src = build_moe(kind, tmp_path / "src")
    with pytest.raises(PrequantError) as e:
        prequant.convert(src, tmp_path / "out", device="cpu", progress=False, quantize_experts=True)
    message = str(e.value)
    assert "\n" not in message and "--quantize-experts" in message and ".experts." in message
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").glob("*.safetensors"))


def test_option_is_recorded_in_the_fingerprint_manifest_summary_and_card(made, tmp_path):
    src, out = made("mixtral")
    plain = prequant.convert(src, tmp_path / "p", dry_run=True)
    flagged = prequant.convert(src, tmp_path / "q", dry_run=True, quantize_experts=True)
    assert plain.to_dict()["quantize_experts"] is False and flagged.to_dict()["quantize_experts"] is True
    manifest = json.loads((out / "prequant.json").read_text())
    assert manifest["options"]["quantize_experts"] is True
    card = (out / "README.md").read_text()
    assert "prequant.load_model" in card and "**transformers 4.x** (tested with 4.57)" in card
    summary = prequant.convert(src, tmp_path / "s", device="cpu", progress=False, quantize_experts=True, stats=False)
    lines = summary.to_text().splitlines()
    assert lines[1].startswith("note: every MoE expert is 4-bit") and "prequant.load_model" in lines[1]


def test_kept_experts_are_said_first_with_both_sizes_and_the_flag(tmp_path):
    src = build_moe("mixtral", tmp_path / "src")
    plan = prequant.convert(src, tmp_path / "unused", dry_run=True)
    flagged = prequant.convert(src, tmp_path / "unused", dry_run=True, quantize_experts=True)
    note = plan.fused_experts_note()
    assert plan.to_text().splitlines()[1] == f"note: {note}"
    sizes = re.search(r"this output is ([\d.]+ [KMG]?B) of [\d.]+ [KMG]?B; with --quantize-experts it would be "
                      r"([\d.]+ [KMG]?B)", note)
    assert sizes and plan.experts_output_bytes == flagged.output_bytes < plan.output_bytes / 1.5
    summary = prequant.convert(src, tmp_path / "out", device="cpu", progress=False, stats=False)
    assert summary.to_text().splitlines()[1] == f"note: {note}"
    card = (tmp_path / "out" / "README.md").read_text()
    assert card.index("--quantize-experts") < card.index("## Quantization")


# ----------------------------------------------------------------------------------- loading


@pytest.mark.parametrize("kind", HANDLED)
def test_load_model_logits_equal_the_dequantized_reference_on_the_cpu(made, kind):
    src, out = made(kind)
    model = prequant.load_model(out)
    assert not any(p.device.type == "meta" for p in model.parameters())
    ours = logits_of(model)
    reference = dequantized_reference(src, out)
    eager = logits_of(reference, "eager")
    spread = (eager - logits_of(reference, "batched_mm")).abs().max().item()
    scale = eager.abs().max().item()
    assert (ours - eager).abs().max().item() <= max(spread, 1e-2 * scale), (kind, spread)
    # and it is the 4-bit model, not the source's: the source's logits are farther away
    source = logits_of(__import__("transformers").AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16))
    assert (ours - eager).abs().max() < (source - eager).abs().max()


@gpu_only
@needs_tested_transformers
@pytest.mark.parametrize("kind", HANDLED)
def test_load_model_logits_equal_the_dequantized_reference_on_the_gpu(made, kind):
    src, out = made(kind)
    model = prequant.load_model(out, device_map="cuda")
    assert {p.device.type for p in model.parameters()} == {"cuda"}
    ours = logits_of(model)
    reference = dequantized_reference(src, out).to("cuda")
    eager = logits_of(reference, "eager")
    spread = (eager - logits_of(reference, "batched_mm")).abs().max().item()
    assert (ours - eager).abs().max().item() <= max(spread, 1e-2 * eager.abs().max().item()), (kind, spread)
    from transformers import AutoModelForCausalLM

    source = logits_of(AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).to("cuda"))
    assert (ours - eager).abs().max() < (source - eager).abs().max()


def test_load_model_holds_one_4bit_linear_per_expert(made):
    import bitsandbytes as bnb

    _, out = made("mixtral")
    model = prequant.load_model(out)
    experts = model.model.layers[1].mlp.experts
    assert len(experts) == 4 and isinstance(experts[2].w1, bnb.nn.Linear4bit)
    assert experts[2].w2.weight.quant_state.shape == torch.Size([64, 128])


def test_plain_transformers_5_refuses_the_output_loudly(made):
    from transformers import AutoModelForCausalLM

    _, out = made("qwen3_moe")
    with pytest.raises(Exception, match=r"(?i)size mismatch|mismatched_sizes"):
        AutoModelForCausalLM.from_pretrained(out)


# ----------------------------------------------------------------------------------- verify


def test_verify_checks_every_expert_and_against_the_source(made, tmp_path):
    from prequant.verify.run import verify

    src, out = made("olmoe")
    report = verify(out, source=str(src), progress=False)
    assert report.ok, report.to_text()
    experts = [k for k in read_all(src) if expert_match(k)]
    assert set(experts) <= set(report.source["tensors"])
    # a damaged expert is caught
    import shutil

    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    shard = next(bad.glob("*.safetensors"))
    tensors = load_file(shard)
    tensors[experts[0]] = torch.zeros_like(tensors[experts[0]])
    save_file(tensors, shard, metadata={"format": "pt"})
    damaged = verify(bad, source=str(src), progress=False)
    assert not damaged.ok and experts[0] in damaged.to_text()


def test_load_model_without_4bit_experts_is_transformers_own_load_exact_on_the_cpu(tmp_path):
    """DeepSeek-V3's attention has 4-bit layers with 32 inputs (its q_b_proj), which bitsandbytes' CPU matmul gets
    wrong: load_model, through transformers' from_pretrained, still gives the dequantized reference's logits."""
    src = build_moe("deepseek_v3", tmp_path / "src")
    out = tmp_path / "out"
    prequant.convert(src, out, device="cpu", progress=False)
    model = prequant.load_model(out, device_map="cpu")
    eager = logits_of(dequantized_reference(src, out), "eager")
    assert (logits_of(model) - eager).abs().max().item() <= 1e-2 * eager.abs().max().item()
    assert type(model.model.layers[0].self_attn.q_b_proj).__name__ == "ExactLinear4bit"
