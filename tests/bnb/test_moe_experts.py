"""`bnb.experts` (which tensors are per-expert weights, the layout with them quantized) and `bnb.moe`'s 4-bit layer
(exact on the CPU)."""

from __future__ import annotations

import pytest
import torch
import transformers
from helpers import gpu_only
from moe_checkpoints import build_moe, dequantized, dequantized_reference, entries_of, logits_of, read_all

from prequant.bnb.experts import expert_match, quantize_experts
from prequant.bnb.layout import analyze
from prequant.bnb.moe import TRANSFORMERS_TESTED
from prequant.bnb.quantize import quantize_tensor
from prequant.checkpoint.hf_files import read_config
from prequant.checkpoint.reader import scan_files
from prequant.errors import PrequantError


def _layout(path, skip=()):
    tensors = scan_files(sorted(path.glob("*.safetensors")))
    return analyze(read_config(path), path, tensors, list(skip)), tensors


def test_expert_names_of_each_naming():
    assert expert_match("model.layers.3.block_sparse_moe.experts.7.w2.weight")["block"] == \
        "model.layers.3.block_sparse_moe"
    assert expert_match("model.layers.0.mlp.experts.12.up_proj.weight")["index"] == "12"
    assert expert_match("model.layers.0.mlp.shared_expert.up_proj.weight") is None
    assert expert_match("model.layers.0.mlp.experts.gate_up_proj") is None


def test_mixtral_experts_quantized_and_routers_skipped(tmp_path):
    layout, tensors = _layout(build_moe("mixtral", tmp_path / "m"))
    assert layout.skip_modules is None and not any(d.quantize for n, d in layout.decisions.items() if expert_match(n))
    new = quantize_experts(layout, tensors)
    experts = [n for n in new.decisions if expert_match(n)]
    assert len(experts) == 2 * 4 * 3 and all(new.decisions[n].quantize and new.decisions[n].fused for n in experts)
    routers = [f"model.layers.{i}.block_sparse_moe.gate" for i in (0, 1)]
    assert new.skip_modules == ["lm_head", *routers]
    assert not new.decisions["model.layers.0.block_sparse_moe.gate.weight"].quantize
    unchanged = {n: d for n, d in layout.decisions.items() if n not in experts}
    assert all(new.decisions[n] == d for n, d in unchanged.items())


def test_experts_matched_by_skip_stay_kept(tmp_path):
    layout, tensors = _layout(build_moe("qwen3_moe", tmp_path / "q"), skip=["model.layers.1"])
    new = quantize_experts(layout, tensors)
    assert not new.decisions["model.layers.1.mlp.experts.0.up_proj.weight"].quantize
    assert new.decisions["model.layers.0.mlp.experts.0.up_proj.weight"].quantize
    assert "model.layers.1" in new.skip_modules and "model.layers.0.mlp.gate" in new.skip_modules


def test_fused_on_disk_experts_are_refused(tmp_path):
    layout, tensors = _layout(build_moe("gpt_oss", tmp_path / "g"))
    with pytest.raises(PrequantError, match=r"--quantize-experts: tensor 'model\.layers\.0\.mlp\.experts\.\w+'"):
        quantize_experts(layout, tensors)


def test_a_dense_model_is_left_as_it_is_with_a_note(tmp_path):
    layout, tensors = _layout(build_moe("llama", tmp_path / "l"))
    new = quantize_experts(layout, tensors)
    assert new.decisions == layout.decisions and new.skip_modules == layout.skip_modules
    assert any("no MoE expert weights" in n for n in new.notes)


# ------------------------------------------------------------------------------ the 4-bit layer on the CPU


@pytest.mark.parametrize("shape", [(1, 64), (4, 64), (64, 32), (8, 96), (128, 64)])
def test_exact_linear_equals_the_dequantized_weight_on_the_cpu(shape):
    """bitsandbytes' CPU 4-bit matmul is wrong (or crashes) when in % 64 or out % 32; the exact layer is not."""
    import bitsandbytes as bnb
    from bitsandbytes.nn import Params4bit

    from prequant.bnb.format import entry_name
    from prequant.bnb.moe import exact_class

    torch.manual_seed(0)
    w = torch.randn(shape, dtype=torch.bfloat16)
    entries = quantize_tensor(w, quant_storage=torch.bfloat16, name="w.weight")
    layer = exact_class()(shape[1], shape[0], bias=False, compute_dtype=torch.bfloat16, device="meta")
    stats = {entry_name("w.weight", f"w.weight.{k}"): v for k, v in entries.items() if k != "weight"}
    layer.weight = Params4bit.from_prequantized(entries["weight"], stats, device="cpu", module=layer)
    assert isinstance(layer, bnb.nn.Linear4bit)
    x = torch.randn(3, shape[1], dtype=torch.bfloat16)
    want = torch.nn.functional.linear(x, dequantized(entries))
    assert torch.equal(layer(x), want)


@gpu_only
@pytest.mark.parametrize("rows", [1, 5])
def test_exact_linear_on_the_gpu_is_the_dequantized_weights_matmul(rows):
    """bitsandbytes' own forward adds in another order than the matmul of the dequantized weight (a fused kernel for
    a single row, as an expert often gets; a transposed weight for many); the exact layer's inference is that
    matmul, what a model holding the dequantized weights computes."""
    from bitsandbytes.nn import Params4bit

    from prequant.bnb.format import entry_name
    from prequant.bnb.moe import exact_class

    torch.manual_seed(0)
    w = torch.randn(512, 4096, dtype=torch.bfloat16)
    entries = quantize_tensor(w, quant_storage=torch.bfloat16, name="w.weight")
    layer = exact_class()(4096, 512, bias=False, compute_dtype=torch.bfloat16, device="meta")
    stats = {entry_name("w.weight", f"w.weight.{k}"): v for k, v in entries.items() if k != "weight"}
    layer.weight = Params4bit.from_prequantized(entries["weight"], stats, device="cuda", module=layer)
    x = torch.randn(rows, 4096, dtype=torch.bfloat16, device="cuda")
    want = torch.nn.functional.linear(x, dequantized(entries).cuda())
    with torch.no_grad():
        assert torch.equal(layer(x).view(torch.int16), want.view(torch.int16))


# ------------------------------------------------------------------------------ CUDA's bytes


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_expert_bytes_equal_bitsandbytes_cuda(tmp_path):
    import prequant

    src = build_moe("qwen2_moe", tmp_path / "src")
    prequant.convert(src, tmp_path / "out", device="cpu", progress=False, quantize_experts=True)
    source, output = read_all(src), read_all(tmp_path / "out")
    for key in [k for k in source if expert_match(k)]:
        cuda = quantize_tensor(source[key], quant_storage=torch.bfloat16, device="cuda", name=key)
        got = entries_of(output, key)
        assert all(torch.equal(got[k].view(torch.uint8), cuda[k].view(torch.uint8)) for k in cuda), key


def test_load_model_refuses_a_transformers_older_than_the_one_its_renamings_are_tested_with(monkeypatch):
    import transformers

    from prequant.bnb.moe import require_transformers
    from prequant.errors import PrequantError

    monkeypatch.setattr(transformers, "__version__", "5.0.0")
    with pytest.raises(PrequantError, match=r"needs transformers 5\.25 or later \(found 5\.0\.0\)"):
        require_transformers()
    monkeypatch.setattr(transformers, "__version__", "5.25.0")
    require_transformers()


# ------------------------------------------------------------------------------ mixed: some experts kept 16-bit


# kind -> what `--skip` keeps 16-bit: layer 0's whole MoE block (its experts stay fused), or every down projection
# (each layer's experts mixed: gate and up 4-bit, down 16-bit).
MIXED = [("mixtral", "model.layers.0.block_sparse_moe"), ("qwen3_moe", "model.layers.0.mlp"),
         ("qwen3_moe", "down_proj")]


def _mixed_logits_equal_the_reference(root, kind: str, skip: str, device: str) -> None:
    from transformers import AutoModelForCausalLM

    import prequant
    from prequant.bnb.moe import PerExpert, exact_class

    src = build_moe(kind, root / "src")
    out = root / "out"
    prequant.convert(src, out, device="cpu", progress=False, quantize_experts=True, skip=[skip])
    model = prequant.load_model(out, device_map=device)
    assert {p.device.type for p in model.parameters()} == {device}
    first, second = (layer.mlp.experts for layer in model.model.layers)
    assert isinstance(second, PerExpert) and isinstance(second[3].role("gate"), exact_class())
    source = {k: v.to(device) for k, v in read_all(src).items()}
    if skip == "down_proj":
        assert isinstance(first, PerExpert) and type(first[1].role("down")) is torch.nn.Linear
        assert torch.equal(first[1].role("down").weight, source["model.layers.0.mlp.experts.1.down_proj.weight"])
    else:
        assert not isinstance(first, PerExpert)
        w = ("w1", "w3", "w2") if kind == "mixtral" else ("gate_proj", "up_proj", "down_proj")
        experts = [f"{skip}.experts.{e}" for e in range(4)]
        gate_up = torch.stack([torch.cat([source[f"{x}.{w[0]}.weight"], source[f"{x}.{w[1]}.weight"]])
                               for x in experts])
        assert torch.equal(first.gate_up_proj, gate_up)
        assert torch.equal(first.down_proj, torch.stack([source[f"{x}.{w[2]}.weight"] for x in experts]))
    ours = logits_of(model)
    reference = dequantized_reference(src, out).to(device)
    eager = logits_of(reference, "eager")
    spread = (eager - logits_of(reference, "batched_mm")).abs().max().item()
    assert (ours - eager).abs().max().item() <= max(spread, 1e-2 * eager.abs().max().item()), spread
    # and it is the 4-bit model, not the source's: the source's logits are farther away
    plain = logits_of(AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).to(device))
    assert (ours - eager).abs().max() < (plain - eager).abs().max()


@pytest.mark.parametrize(("kind", "skip"), MIXED)
def test_load_model_of_4bit_and_kept_experts_gives_the_dequantized_reference_s_logits(tmp_path, kind, skip):
    """Layers whose experts `--skip` keeps load as transformers' fused experts (or, where a layer's experts are part
    4-bit, as 16-bit linears beside the 4-bit ones); the rest as one 4-bit linear per expert."""
    _mixed_logits_equal_the_reference(tmp_path, kind, skip, "cpu")


@gpu_only
@pytest.mark.skipif(tuple(int(p) for p in transformers.__version__.split(".")[:2]) < TRANSFORMERS_TESTED,
                    reason="prequant.load_model needs transformers 5.25 or later (carry its wheel to the GPU machine)")
@pytest.mark.parametrize(("kind", "skip"), MIXED)
def test_load_model_of_4bit_and_kept_experts_on_the_gpu(tmp_path, kind, skip):
    _mixed_logits_equal_the_reference(tmp_path, kind, skip, "cuda")
