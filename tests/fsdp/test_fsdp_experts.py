"""load_for_fsdp on MoE checkpoints with 4-bit experts (`--quantize-experts`): 2 gloo ranks train SFTTrainer steps
with LoRA on every expert's projections, and the adapter (its keys naming the expert) reloads on `load_model` and
merges (`prequant merge`) into a checkpoint transformers loads. With experts kept 16-bit, the model holds
transformers 5's fused experts, each rank its own experts, LoRA on attention; with some layers' experts kept by
`--skip` and the others 4-bit, both at once, and LoRA on every expert.

The distributed part runs this very file under torchrun as a worker (`--worker CONFIG_JSON`).

    python -m pytest -q tests/fsdp/test_fsdp_experts.py
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest
import torch
from helpers import finish_worker, torchrun

PROBE = [[4, 6, 8, 9, 4, 10, 18, 4, 7, 11, 12, 4, 13, 2], [2, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 3, 1]]


def _probe(model) -> tuple[torch.Tensor, dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    """The model's logits on PROBE, and per MoE layer the experts its router chose for each token (sorted) with the
    router's logits (transformers' routers, the `*.gate` modules, return logits, weights and the experts chosen)."""
    routes: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    hooks = []
    for name, module in model.named_modules():
        layer = re.search(r"layers\.(\d+)\.mlp\.gate$", name)
        if layer:
            def keep(_module, _inputs, out, i=int(layer[1])):
                routes[i] = (out[2].sort(-1).values.reshape(len(PROBE), len(PROBE[0]), -1).cpu(),
                             out[0].float().reshape(len(PROBE), len(PROBE[0]), -1).cpu())
            hooks.append(module.register_forward_hook(keep))
    try:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor(PROBE)).logits
    finally:
        for hook in hooks:
            hook.remove()
    assert routes, "no router found"
    return logits, routes


def _assert_probe_logits_match(model, record: dict) -> None:
    """`model`'s logits on PROBE are the sharded model's (`record`) within bf16 rounding (2% of the largest), and so
    are its routers' logits. At every position whose experts both models' routers chose alike, the logits are
    compared; a position where the choice differs must be a tie (the gap between the last expert chosen and the
    next no more than twice the two routers' difference there), and is left out, with the later positions of its
    sequence when a later layer's attention carries the difference on. At least half the positions are compared."""
    logits, routes = _probe(model)
    sharded, sharded_routes = record["probe_logits"].float(), record["routes"]
    assert set(routes) == set(sharded_routes)
    compared = torch.ones(len(PROBE), len(PROBE[0]), dtype=torch.bool)
    last = max(routes)
    for layer, (chosen, router) in routes.items():
        their_chosen, their_router = sharded_routes[layer]
        assert (router - their_router).abs().max() <= 2e-2 * their_router.abs().max(), f"layer {layer}'s router"
        for b, t in (chosen != their_chosen).any(-1).nonzero().tolist():
            top, k = router[b, t].sort(descending=True).values, chosen.shape[-1]
            drift = (router[b, t] - their_router[b, t]).abs().max()
            assert top[k - 1] - top[k] <= 2 * drift, f"layer {layer}, token {b},{t}: experts differ without a tie"
            compared[b, t if layer == last else slice(t, None)] = False
    assert compared.sum() >= compared.numel() / 2, "too few positions routed alike to compare"
    diff = (logits.float() - sharded).abs()[compared]
    assert diff.max().item() <= 2e-2 * sharded.abs().max().item()


def _train(kind: str, root: Path, quantize_experts: bool, skip: tuple[str, ...] = ()) -> dict:
    """A tiny `kind` MoE converted (with or without 4-bit experts, `skip` kept) and trained on 2 gloo ranks by the
    worker."""
    from helpers import build_tokenizer
    from moe_checkpoints import build_moe

    import prequant

    src = build_moe(kind, root / "src")
    prequant.convert(src, root / "ckpt", device="cpu", progress=False, quantize_experts=quantize_experts,
                     skip=list(skip))
    config = {"checkpoint": str(root / "ckpt"), "tokenizer": str(build_tokenizer(root / "tok")),
              "out": str(root / "run")}
    torchrun(__file__, "--worker", json.dumps(config))
    record = torch.load(root / "run" / "record.pt", weights_only=False)
    return {**config, "source": str(src), "record": record, "kind": kind}


@pytest.fixture(scope="module", params=["mixtral", "qwen2_moe"])
def trained(request, tmp_path_factory) -> dict:
    return _train(request.param, tmp_path_factory.mktemp(request.param), quantize_experts=True)


@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe"])
def kept(request, tmp_path_factory) -> dict:
    return _train(request.param, tmp_path_factory.mktemp(f"{request.param}-kept"), quantize_experts=False)


# kind -> the MoE block whose experts `--skip` keeps 16-bit (the checkpoint's name for it)
MIXED = {"mixtral": "model.layers.0.block_sparse_moe", "qwen3_moe": "model.layers.0.mlp"}


@pytest.fixture(scope="module", params=list(MIXED))
def mixed(request, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp(f"{request.param}-mixed")
    return _train(request.param, root, quantize_experts=True, skip=(MIXED[request.param],))


@pytest.mark.slow
def test_two_ranks_train_lora_on_every_expert(trained):
    record = trained["record"]
    assert record["first_batches"][0] != record["first_batches"][1]  # the trainer gave each rank its own rows
    losses = record["losses"]
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
    experts = {n for n in record["lora"] if ".experts." in n and ".lora_B." in n}
    proj = ("w1", "w2", "w3") if trained["kind"] == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    assert len(experts) == 2 * 4 * 3  # two layers of four experts, three projections each
    assert {n.split(".experts.")[1].split(".")[1] for n in experts} == set(proj)
    assert any(record["lora"][n].abs().sum() > 0 for n in experts)  # trained


@pytest.mark.slow
def test_adapter_names_each_expert_and_reloads_with_the_same_logits(trained):
    from peft import PeftModel
    from safetensors import safe_open

    import prequant
    from prequant.fsdp.experts import lora_targets_as_named

    adapter = Path(trained["out"]) / "final"
    with safe_open(adapter / "adapter_model.safetensors", "pt") as f:
        keys = list(f.keys())
    assert any(".experts.3." in k and ".lora_A." in k for k in keys)
    model = prequant.load_model(trained["checkpoint"])
    with lora_targets_as_named(model):
        model = PeftModel.from_pretrained(model, adapter)
    _assert_probe_logits_match(model, trained["record"])


@pytest.mark.slow
def test_two_ranks_train_a_checkpoint_with_16bit_experts_as_transformers_fuses_them(kept):
    """Without --quantize-experts the experts stay 16-bit: the model holds transformers 5's fused experts (gate rows,
    then up rows), filled from the checkpoint's per-expert weights, their rows split between the ranks; LoRA goes on
    attention and, through peft's own LoRA of fused expert parameters, on the experts."""
    from moe_checkpoints import read_all

    record = kept["record"]
    assert len(record["losses"]) == 3 and all(torch.isfinite(torch.tensor(record["losses"])))
    for part in (".self_attn.q_proj.lora_B.", ".mlp.experts.lora_B."):
        assert any(part in n and record["lora"][n].abs().sum() > 0 for n in record["lora"]), part  # trained
    source = read_all(Path(kept["source"]))
    w = ("w1", "w3", "w2") if kept["kind"] == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    block = "block_sparse_moe" if kept["kind"] == "mixtral" else "mlp"
    assert set(record["experts"]) == {f"model.layers.{i}.mlp.experts.{p}" for i in (0, 1)
                                      for p in ("gate_up_proj", "down_proj")}
    for i in (0, 1):
        experts = [f"model.layers.{i}.{block}.experts.{e}" for e in range(4)]
        gate_up = torch.stack([torch.cat([source[f"{x}.{w[0]}.weight"], source[f"{x}.{w[1]}.weight"]])
                               for x in experts])
        down = torch.stack([source[f"{x}.{w[2]}.weight"] for x in experts])
        assert torch.equal(record["experts"][f"model.layers.{i}.mlp.experts.gate_up_proj"], gate_up)
        assert torch.equal(record["experts"][f"model.layers.{i}.mlp.experts.down_proj"], down)
    assert record["experts_local_rows"] == [2, 2]  # four experts, two per rank


@pytest.mark.slow
def test_adapter_of_16bit_experts_reloads_with_the_same_logits(kept):
    from peft import PeftModel

    import prequant

    model = PeftModel.from_pretrained(prequant.load_model(kept["checkpoint"]), Path(kept["out"]) / "final")
    _assert_reloaded_as_trained(model, kept["record"])


@pytest.mark.slow
def test_trained_adapter_merged_into_the_4bit_base_loads_with_the_trained_logits(trained, tmp_path):
    """`prequant merge` of what the ranks trained: a 16-bit checkpoint transformers loads as it is (experts fused
    again), with the sharded model's logits."""
    from transformers import AutoModelForCausalLM

    import prequant

    prequant.merge(Path(trained["out"]) / "final", tmp_path / "merged", base=trained["checkpoint"], device="cpu",
                   progress=False)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype="auto").eval()
    _assert_probe_logits_match(model, trained["record"])


def _merged(run: dict, out: Path):
    """`prequant merge` of what the ranks trained into the checkpoint they trained on, loaded by transformers."""
    from transformers import AutoModelForCausalLM

    import prequant

    prequant.merge(Path(run["out"]) / "final", out, base=run["checkpoint"], device="cpu", progress=False)
    return AutoModelForCausalLM.from_pretrained(out, dtype="auto").eval()


@pytest.mark.slow
def test_adapter_of_16bit_experts_on_4bit_experts_is_refused_in_one_line(kept, tmp_path):
    """An adapter trained on fused 16-bit experts, loaded on the same model with 4-bit experts one linear each: peft
    would drop the experts' LoRA with a warning; loading it as documented (`lora_targets_as_named`) is refused,
    naming the layer and what to do."""
    from peft import PeftModel

    import prequant
    from prequant.errors import PrequantError
    from prequant.fsdp.experts import lora_targets_as_named

    prequant.convert(kept["source"], tmp_path / "nf4", device="cpu", progress=False, quantize_experts=True)
    model = prequant.load_model(tmp_path / "nf4")
    with pytest.raises(PrequantError, match=r"^adapter 'default' holds LoRA of model\.layers\.0\.mlp\.experts\."
                                            r"(gate_up|down)_proj, fused 16-bit experts.*`prequant merge`$"):
        with lora_targets_as_named(model):
            PeftModel.from_pretrained(model, Path(kept["out"]) / "final")


@pytest.mark.slow
def test_adapter_of_16bit_experts_merges_and_loads_with_the_trained_logits(kept, tmp_path):
    _assert_probe_logits_match(_merged(kept, tmp_path / "merged"), kept["record"])


@pytest.mark.slow
def test_adapter_of_4bit_and_kept_experts_merges_and_loads_with_the_trained_logits(mixed, tmp_path):
    """The kept layer's LoRA is on transformers' fused parameters (target_parameters): merged into that layer's
    per-expert 16-bit tensors, the 4-bit layer's into its dequantized experts."""
    config = json.loads((Path(mixed["out"]) / "final" / "adapter_config.json").read_text())
    assert config["target_parameters"]
    model = _merged(mixed, tmp_path / "merged")
    merged = json.loads((tmp_path / "merged" / "prequant.json").read_text())["merge"]["targets"]
    projections = ("w1", "w3", "w2") if mixed["kind"] == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    assert {f"{MIXED[mixed['kind']]}.experts.{e}.{p}.weight" for e in range(4) for p in projections} <= set(merged)
    _assert_probe_logits_match(model, mixed["record"])


@pytest.mark.slow
def test_two_ranks_train_4bit_experts_beside_kept_ones(mixed):
    """Layer 0's experts kept by --skip: transformers' fused experts, filled from the source's weights, their rows split
    between the ranks, LoRA on their fused parameters; layer 1's experts 4-bit, LoRA on each expert's linears."""
    from moe_checkpoints import read_all

    record = mixed["record"]
    assert len(record["losses"]) == 3 and all(torch.isfinite(torch.tensor(record["losses"])))
    proj = ("w1", "w3", "w2") if mixed["kind"] == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    per_expert = {n for n in record["lora"] if ".layers.1.mlp.experts." in n and ".lora_B." in n}
    assert {n.split(".experts.")[1].split(".")[1] for n in per_expert} == set(proj) and len(per_expert) == 4 * 3
    fused = [n for n in record["lora"] if ".layers.0.mlp.experts." in n and ".lora_B." in n]
    assert len(fused) == 2  # peft's LoRA of the fused gate_up_proj and down_proj (one wrapping the other)
    for part in (".self_attn.q_proj.lora_B.", *fused, ".layers.1.mlp.experts.3."):
        assert any(part in n and record["lora"][n].abs().sum() > 0 for n in record["lora"]), part  # trained
    source = read_all(Path(mixed["source"]))
    experts = [f"{MIXED[mixed['kind']]}.experts.{e}" for e in range(4)]
    gate_up = torch.stack([torch.cat([source[f"{x}.{proj[0]}.weight"], source[f"{x}.{proj[1]}.weight"]])
                           for x in experts])
    assert set(record["experts"]) == {"model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"}
    assert torch.equal(record["experts"]["model.layers.0.mlp.experts.gate_up_proj"], gate_up)
    assert torch.equal(record["experts"]["model.layers.0.mlp.experts.down_proj"],
                       torch.stack([source[f"{x}.{proj[2]}.weight"] for x in experts]))
    assert record["experts_local_rows"] == [2, 2]  # four experts, two per rank


@pytest.mark.slow
def test_adapter_of_4bit_and_kept_experts_reloads_with_the_same_logits(mixed):
    from peft import PeftModel

    import prequant
    from prequant.fsdp.experts import lora_targets_as_named

    model = prequant.load_model(mixed["checkpoint"])
    with lora_targets_as_named(model):
        model = PeftModel.from_pretrained(model, Path(mixed["out"]) / "final")
    _assert_reloaded_as_trained(model, mixed["record"])


def _assert_reloaded_as_trained(model, record: dict) -> None:
    """Every LoRA weight the ranks trained is in `model` as it was, and its logits on the probe are the sharded
    model's within bf16 rounding (`_assert_probe_logits_match`)."""
    params = dict(model.named_parameters())
    trained = record["lora"]
    assert [n for n in trained if torch.equal(params[n].float(), trained[n].float())] == list(trained)
    _assert_probe_logits_match(model, record)


def test_lora_on_kept_experts_follows_the_targets_and_refuses_gate_without_up(tmp_path):
    """The kept layer's fused parameters get LoRA for the projections targeted; gate without up (one parameter
    there) is refused in one line naming the layer."""
    from moe_checkpoints import build_moe

    import prequant
    from prequant.errors import PrequantError
    from prequant.fsdp.experts import lora_on_fused
    from prequant.fsdp.loader import lora_config

    src = build_moe("mixtral", tmp_path / "src")
    prequant.convert(src, tmp_path / "out", device="cpu", progress=False, quantize_experts=True,
                     skip=[MIXED["mixtral"]])
    model = prequant.load_model(tmp_path / "out")
    config = lora_config(4, 8, 0.0, ["q_proj", "w2"])
    lora_on_fused(model, config)
    assert config.target_parameters == ["model.layers.0.mlp.experts.down_proj"] and not config.rank_pattern
    config = lora_config(4, 8, 0.0, "all-linear")
    lora_on_fused(model, config)
    assert config.target_parameters == [f"model.layers.0.mlp.experts.{p}" for p in ("down_proj", "gate_up_proj")]
    assert config.rank_pattern == {r".*\.gate_up_proj": 8} and config.alpha_pattern == {r".*\.gate_up_proj": 16}
    with pytest.raises(PrequantError, match=r"^model\.layers\.0\.mlp\.experts: LoRA on w1 alone .* target w1 and w3 "
                                            r"together, or neither$"):
        lora_on_fused(model, lora_config(4, 8, 0.0, ["w1", "w2"]))


# ----------------------------------------------------------------------------------------- the worker


def _worker(config: dict) -> None:
    """SFTTrainer as a user's script runs it: the trainer shards a dataset of different texts between the ranks,
    with activation checkpointing, two micro-batches a step and the router's auxiliary loss."""
    import random

    import torch.distributed as dist
    from datasets import Dataset
    from helpers import TOKENIZER_WORDS
    from transformers import AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    import prequant
    from prequant.fsdp import trainer_args

    out = Path(config["out"])
    model = prequant.load_for_fsdp(config["checkpoint"], lora_r=4, lora_alpha=8, seed=0)
    model.config.output_router_logits = True
    args = trainer_args(SFTConfig(output_dir=str(out), max_steps=3, per_device_train_batch_size=2, learning_rate=1e-2,
                                  gradient_accumulation_steps=2, gradient_checkpointing=True,
                                  logging_steps=1, bf16=True, use_cpu=True, report_to="none", seed=0,
                                  disable_tqdm=True, max_length=32, save_strategy="no"))
    tokenizer = AutoTokenizer.from_pretrained(config["tokenizer"])
    words = random.Random(0)
    rows = [{"text": " ".join(words.choices(TOKENIZER_WORDS, k=words.randint(6, 24)))} for _ in range(32)]
    first: list[list[int]] = []
    seen = model.register_forward_pre_hook(
        lambda _m, _a, kwargs: first.append(kwargs["input_ids"][0].tolist()) if not first else None, with_kwargs=True)
    trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tokenizer)
    trainer.train()
    seen.remove()
    trainer.save_model(str(out / "final"))
    batches = [None] * dist.get_world_size()
    dist.all_gather_object(batches, first[0])
    logits, routes = _probe(model)
    lora = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    fused = {n.removeprefix("base_model.model.").replace(".base_layer", ""): p for n, p in model.named_parameters()
             if n.endswith(("gate_up_proj", "down_proj")) and p.dim() == 3}  # 16-bit experts, fused
    rows = [0] * dist.get_world_size()
    dist.all_gather_object(rows, next((p.to_local().shape[0] for p in fused.values()), 0))
    record = {"losses": [h["loss"] for h in trainer.state.log_history if "loss" in h], "probe_logits": logits,
              "first_batches": batches,
              "routes": routes, "lora": lora, "experts": {n: p.full_tensor().detach().clone() for n, p in fused.items()},
              "experts_local_rows": rows}
    finish_worker(record, out / "record.pt")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", required=True)
    _worker(json.loads(parser.parse_args().worker))
