"""`prequant merge` of LoRA on transformers 5's fused experts (peft's target_parameters: what peft makes of
gate/up/down targets on a fused MoE model) into bases that store one tensor per expert and projection: expert e's
share of the fused parameter's delta goes to its own tensors, gate rows to gate_proj (w1), up rows to up_proj (w3).
The merged expert tensors equal the slices of peft's merge_and_unload of the fused model (adapter and model in
float32, rounded once to the base's bf16), and the merged model's logits equal PeftModel(base, adapter)'s."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from adapters import TOKENS, assert_logits_close, load_base, logits, make_adapter, peft_logits
from helpers import read_checkpoint
from moe_checkpoints import build_moe, dequantized, entries_of

import prequant
from prequant.bnb.experts import ROLES, expert_match
from prequant.errors import PrequantError

# kind -> its experts' projections as the checkpoint names them (gate, up, down)
PROJECTIONS = {"mixtral": ("w1", "w3", "w2"), "qwen3_moe": ("gate_proj", "up_proj", "down_proj")}


def fused_merge(base: Path, adapter: Path) -> dict[str, torch.Tensor]:
    """peft's merge_and_unload of `adapter` into `base` loaded in float32 (transformers 5: experts fused)."""
    from peft import PeftModel

    model = PeftModel.from_pretrained(load_base(base, torch.float32), adapter).merge_and_unload()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def fused_slice(fused: dict[str, torch.Tensor], key: str) -> torch.Tensor:
    """The rows of transformers' fused parameter that the checkpoint's per-expert tensor `key` is."""
    m = expert_match(key)
    experts = f"{m['block'].replace('.block_sparse_moe', '.mlp')}.experts"
    e, role = int(m["index"]), ROLES[m["proj"]]
    if role == "down":
        return fused[f"{experts}.down_proj"][e]
    gate_up = fused[f"{experts}.gate_up_proj"][e]
    rows = gate_up.shape[0] // 2
    return gate_up[:rows] if role == "gate" else gate_up[rows:]


def assert_equals_fused_merge(out: Path, base: Path, adapter: Path) -> set[str]:
    """Every tensor of `out` is peft's float32 merge (its fused experts sliced) rounded to the base's dtype; the
    names of those the adapter changed."""
    ours, source, reference = read_checkpoint(out), read_checkpoint(base), fused_merge(base, adapter)
    assert set(ours) == set(source)
    for key, value in ours.items():
        expected = fused_slice(reference, key) if expert_match(key) else reference[key.replace(".block_sparse_moe.", ".mlp.")]
        assert torch.equal(value, expected.to(value.dtype)), key
    return {k for k in ours if not torch.equal(ours[k], source[k])}


@pytest.fixture(scope="module", params=list(PROJECTIONS))
def moe(request, tmp_path_factory) -> tuple[str, Path]:
    return request.param, build_moe(request.param, tmp_path_factory.mktemp(request.param) / "base")


@pytest.mark.parametrize("targets", ["projections", "all-linear"])
def test_peft_lora_on_fused_experts_merges_into_each_experts_tensors(targets, moe, tmp_path):
    """target_modules naming the experts' projections (or all-linear): peft puts the LoRA on the fused parameters
    (rank and alpha doubled on gate_up_proj), nested on one module, and with all-linear on Mixtral's router weight
    too (a bare 2-D parameter); every expert of every layer changes."""
    kind, base = moe
    gate, up, down = PROJECTIONS[kind]
    adapter = make_adapter(base, tmp_path / "adapter",
                           target_modules=["q_proj", gate, up, down] if targets == "projections" else "all-linear")
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert {"down_proj", "gate_up_proj"} <= set(config["target_parameters"])
    prequant.merge(adapter, tmp_path / "out", base=base, device="cpu", progress=False)
    changed = assert_equals_fused_merge(tmp_path / "out", base, adapter)
    experts = {k for k in read_checkpoint(base) if expert_match(k)}
    assert experts <= changed and len(experts) == 2 * 4 * 3
    routers = {k for k in read_checkpoint(base) if k.endswith(".gate.weight")}
    assert len(routers) == 2 and (routers <= changed) == (targets == "all-linear")
    manifest = json.loads((tmp_path / "out" / "prequant.json").read_text())
    assert set(manifest["merge"]["targets"]) == changed
    assert_logits_close(logits(tmp_path / "out", TOKENS), peft_logits(base, adapter, TOKENS))


def test_target_parameters_by_full_name_with_patterns_and_rslora(moe, tmp_path):
    """LoRA on one layer's down_proj alone (one wrapper, no nesting) and another's gate_up_proj, named in full, with
    rank and alpha patterns and rsLoRA: only those experts' tensors change."""
    kind, base = moe
    adapter = make_adapter(base, tmp_path / "adapter", target_modules=None, use_rslora=True,
                           target_parameters=["model.layers.0.mlp.experts.down_proj",
                                              "model.layers.1.mlp.experts.gate_up_proj"],
                           rank_pattern={"layers.1.mlp.experts.gate_up_proj": 6}, alpha_pattern={"down_proj": 3})
    prequant.merge(adapter, tmp_path / "out", base=base, device="cpu", progress=False)
    changed = assert_equals_fused_merge(tmp_path / "out", base, adapter)
    gate, up, down = PROJECTIONS[kind]
    block = "block_sparse_moe" if kind == "mixtral" else "mlp"
    assert changed == {f"model.layers.{layer}.{block}.experts.{e}.{proj}.weight" for e in range(4)
                       for layer, projs in ((0, [down]), (1, [gate, up])) for proj in projs}
    assert_logits_close(logits(tmp_path / "out", TOKENS), peft_logits(base, adapter, TOKENS))


def test_into_the_4bit_experts_of_the_base_and_quantized_again(tmp_path):
    """Into the base's --quantize-experts conversion: each expert's W is its dequantized 4-bit weight, then the rule;
    with --quantize, the merged experts are what converting the 16-bit merge with --quantize-experts writes."""
    from safetensors.torch import load_file

    base = build_moe("mixtral", tmp_path / "base")
    converted = tmp_path / "nf4"
    prequant.convert(base, converted, device="cpu", progress=False, quantize_experts=True)
    adapter = make_adapter(base, tmp_path / "adapter", target_modules=["w1", "w3", "w2"])
    prequant.merge(adapter, tmp_path / "merged16", base=converted, device="cpu", progress=False)
    ours, stored = read_checkpoint(tmp_path / "merged16"), read_checkpoint(converted)
    lora = load_file(adapter / "adapter_model.safetensors")
    config = json.loads((adapter / "adapter_config.json").read_text())
    for key in [k for k in ours if expert_match(k)]:
        m = expert_match(key)
        experts, e, role = f"base_model.model.model.layers.{m['block'].split('.')[2]}.mlp.experts", int(m["index"]), \
            ROLES[m["proj"]]
        prefix = f"{experts}.base_layer" if role != "down" else experts  # gate_up_proj is wrapped first: inside
        a, b = lora[f"{prefix}.lora_A.weight"], lora[f"{prefix}.lora_B.weight"]
        r = a.shape[0] // 4
        scaling = (2 * config["lora_alpha"] if role != "down" else config["lora_alpha"]) / r
        rows = b.shape[0] // 2 if role != "down" else b.shape[0]
        part = slice(rows, 2 * rows) if role == "up" else slice(0, rows)
        w = dequantized(entries_of(stored, key))
        expected = (w.float() + (b[part, e::4] @ a[e * r:(e + 1) * r]) * scaling).to(w.dtype)
        assert torch.equal(ours[key], expected), key
    prequant.convert(tmp_path / "merged16", tmp_path / "reference", device="cpu", progress=False,
                     quantize_experts=True)
    prequant.merge(adapter, tmp_path / "out", base=converted, device="cpu", progress=False, quantize=True)
    quantized, reference = read_checkpoint(tmp_path / "out"), read_checkpoint(tmp_path / "reference")
    assert set(quantized) == set(stored)
    for key, value in quantized.items():
        expected = reference[key] if ".experts." in key else stored[key]
        assert torch.equal(value.view(torch.uint8), expected.view(torch.uint8)), key


def test_what_cannot_be_merged_exactly_is_refused_naming_it(moe, tmp_path):
    kind, base = moe
    gate, up, down = PROJECTIONS[kind]
    adapter = make_adapter(base, tmp_path / "adapter", target_modules=[gate, up, down])
    config = json.loads((adapter / "adapter_config.json").read_text())
    rank = r"the LoRA of 'model.layers.0.mlp.experts.gate_up_proj' has A .* not rank 4 .* on 4 experts"
    nested = (r"adapter key 'base_model\.model\.model\.layers\.\d\.mlp\.experts\.base_layer\.lora_[AB]\.weight' "
              r"is the LoRA of no parameter")
    cases = {
        "bias": ({**config, "target_parameters": [*config["target_parameters"], "gate_up_proj_bias"]},
                 r"target_parameters entry 'gate_up_proj_bias' is neither a fused experts parameter"),
        "rank": ({**config, "rank_pattern": {}}, rank),
        "one-parameter": ({**config, "target_parameters": ["down_proj"]}, nested),
    }
    for name, (changed, message) in cases.items():
        broken = tmp_path / name
        shutil.copytree(adapter, broken)
        (broken / "adapter_config.json").write_text(json.dumps(changed))
        with pytest.raises(PrequantError, match=message) as e:
            prequant.merge(broken, tmp_path / f"out-{name}", base=base, device="cpu", progress=False)
        assert "\n" not in str(e.value)
    dense = build_moe("llama", tmp_path / "dense")
    with pytest.raises(PrequantError, match=r"LoRA on 'model.layers.0.mlp.experts.gate_up_proj' matches no complete "
                                            r"set of per-expert tensors"):
        prequant.merge(adapter, tmp_path / "out-dense", base=dense, device="cpu", progress=False)
