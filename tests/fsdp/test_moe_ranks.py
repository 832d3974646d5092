"""MoE QLoRA as data-parallel runs train it: every rank its own batches, so an expert idle on one rank is busy on
another, and the LoRA after the ranks' steps is what one process gets on their batches put together.

For each MoE architecture prequant loads (Mixtral, Qwen2-MoE with its shared expert, Qwen3-MoE, OLMoE, DeepSeek-V3,
GLM-4-MoE) and each layout `load_for_fsdp` builds (4-bit experts, one linear each; 16-bit experts, transformers'
fused parameters; the two in one model, `--skip` keeping a layer's experts), and for a dense Llama: 2 gloo ranks
take SGD steps with LoRA on attention and every expert, each rank on its own token ids; one process takes the same
steps on the ranks' batches concatenated (world size 1, the same loader). The worker records which experts each
rank's router chose, and the tests assert that some expert really was idle on one rank and busy on the other.

The comparison is in float32 (`dtype=torch.float32`, and the 4-bit layers' compute dtype set to float32 in the
checkpoints' config), so that what may differ is the order of the sums only; in bfloat16 a sum whose order differs
may round across a bf16 step, and that difference grows through the layers. The tolerance is the one the dense
checkpoint, which has no experts, meets.

The distributed part runs this very file under torchrun as a worker (`--worker SPEC_JSON`).

    python -m pytest -q tests/fsdp/test_moe_ranks.py
"""

from __future__ import annotations

import argparse
import json
import os
import re
from pathlib import Path

import pytest
import torch
from helpers import finish_worker, torchrun

pytestmark = pytest.mark.slow  # every test runs ranks in processes

KINDS = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "glm4_moe"]
LAYOUTS = ["4bit", "16bit", "mixed"]
# The first MoE block of each kind (3 layers; DeepSeek-V3's and GLM-4-MoE's layer 0 is dense), as the checkpoint
# names it: `--skip` keeps its experts 16-bit in the mixed layout.
FIRST_MOE = {"mixtral": "model.layers.0.block_sparse_moe", "deepseek_v3": "model.layers.1.mlp",
             "glm4_moe": "model.layers.1.mlp"}
ROUTER_LOSS = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"]  # the kinds whose forward takes output_router_logits
LR = 1.0
TOKENS = 8  # per rank and micro-batch: few enough that some expert gets no token on some rank
# |LoRA after 2 ranks - after 1 process| <= RELATIVE * its update + ABSOLUTE * the largest update of the model: the
# float32 sums' order. The dense checkpoint meets it (test_dense_ranks_match_one_process) as every MoE layout must; a
# gradient lost or averaged with another rank's wrong one is off by the order of its update.
RELATIVE, ABSOLUTE = 1e-4, 1e-6


def _ids(seed: int, steps: int, micro: int = 1, ranks: int = 2) -> list[list[list[list[int]]]]:
    """steps x micro-batches x ranks x [1, TOKENS] token ids, each rank its own. In the first step rank 0's sequences
    repeat one token: every position then holds the same hidden state, so each MoE layer sends all of them to the
    same experts and leaves the others idle on rank 0, while rank 1's different tokens reach them."""
    g = torch.Generator().manual_seed(seed)

    def batch(step: int, rank: int) -> list[list[int]]:
        if step == 0 and rank == 0:
            return torch.randint(2, 256, (1, 1), generator=g).repeat(1, TOKENS).tolist()
        return torch.randint(2, 256, (1, TOKENS), generator=g).tolist()

    return [[[batch(step, r) for r in range(ranks)] for _ in range(micro)] for step in range(steps)]


def _checkpoint(kind: str, layout: str, root: Path) -> Path:
    from helpers import build_checkpoint
    from moe_checkpoints import build_moe

    import prequant

    out = root / f"{kind}-{layout}"
    if kind == "llama":
        src = build_checkpoint("llama", root / "llama-src")
        prequant.convert(src, out, device="cpu", progress=False)
        return _float32_compute(out)
    src = root / f"{kind}-src"
    if not src.exists():
        build_moe(kind, src, layers=3)
    skip = [FIRST_MOE.get(kind, "model.layers.0.mlp")] if layout == "mixed" else []
    prequant.convert(src, out, device="cpu", progress=False, quantize_experts=layout != "16bit", skip=skip)
    return _float32_compute(out)


def _float32_compute(checkpoint: Path) -> Path:
    config = json.loads((checkpoint / "config.json").read_text())
    config["quantization_config"]["bnb_4bit_compute_dtype"] = "float32"
    (checkpoint / "config.json").write_text(json.dumps(config, indent=2))
    return checkpoint


def _run(spec: dict, nproc: int, out: Path) -> dict:
    torchrun(__file__, "--worker", json.dumps({**spec, "out": str(out)}), nproc=nproc, timeout=1200)
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Every job on 2 ranks and on 1 process: {"ranks": {job: record}, "one": {job: record}}."""
    root = tmp_path_factory.mktemp("moe-ranks")
    jobs = []
    for i, kind in enumerate([*KINDS, "llama"]):
        for layout in LAYOUTS if kind != "llama" else ["4bit"]:
            jobs.append({"name": f"{kind}-{layout}", "checkpoint": str(_checkpoint(kind, layout, root)),
                         "steps": _ids(i, steps=2)})
    # What users switch on: activation checkpointing (routing recomputed in backward) with gradient accumulation.
    for i, (kind, layout) in enumerate([("mixtral", "4bit"), ("qwen3_moe", "mixed"), ("deepseek_v3", "4bit")]):
        jobs.append({"name": f"{kind}-{layout}-checkpointing-accumulation", "gc": True,
                     "checkpoint": str(root / f"{kind}-{layout}"), "steps": _ids(100 + i, steps=2, micro=2)})
    # LoRA on attention alone (targets that match no expert), and targets that match nothing at all (an error on
    # every rank, before any collective: never a hang).
    for name, targets in (("mixtral-4bit-attention", ["q_proj", "v_proj"]), ("mixtral-4bit-no-target", ["w9"])):
        jobs.append({"name": name, "targets": targets, "checkpoint": str(root / "mixtral-4bit"), "steps": _ids(7, 2)})
    # The router's auxiliary loss (output_router_logits=True) on per-rank data: it balances each rank's own tokens, so
    # it is not one process's on the concatenation; 2 ranks only.
    for i, kind in enumerate(ROUTER_LOSS):
        jobs.append({"name": f"{kind}-4bit-router-loss", "router_loss": True, "ranks_only": True,
                     "checkpoint": str(root / f"{kind}-4bit"), "steps": _ids(KINDS.index(kind), steps=2)})
    spec = {"jobs": jobs}
    return {"ranks": _run(spec, 2, root / "ranks.pt"), "one": _run(spec, 1, root / "one.pt")}


def _idle_on_one_busy_on_other(record: dict) -> list[tuple]:
    """(step, micro-batch, layer, expert) where one rank's router chose the expert and the other's did not."""
    found = []
    for (step, micro, layer), per_rank in record["routes"].items():
        for expert in set.union(*per_rank) - set.intersection(*per_rank):
            found.append((step, micro, layer, expert))
    return found


def _assert_same_lora(ranks: dict, one: dict) -> None:
    """Every LoRA parameter after the 2 ranks' steps is the one process's, within RELATIVE of its update and ABSOLUTE
    of the model's largest."""
    assert ranks["lora"].keys() == one["lora"].keys()
    updates = {n: (v - one["init"][n]).abs().max().item() for n, v in one["lora"].items()}
    largest = max(updates.values())
    assert largest > 0
    for name, value in one["lora"].items():
        err = (ranks["lora"][name] - value).abs().max().item()
        assert err <= RELATIVE * updates[name] + ABSOLUTE * largest, f"{name}: {err} apart, its update {updates[name]}"


def test_dense_ranks_match_one_process(runs):
    """The path that works without experts sets the tolerance: 2 ranks on their own batches, 1 process on both."""
    ranks, one = runs["ranks"]["llama-4bit"], runs["one"]["llama-4bit"]
    assert len(ranks["lora"]) == 2 * 7 * 2  # two layers' attention and MLP linears, A and B
    _assert_same_lora(ranks, one)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", KINDS)
def test_experts_idle_on_one_rank_train_as_one_process(runs, kind, layout):
    """Per-rank data on every layout: the ranks' routers leave some expert idle on one rank and busy on the other,
    the steps complete, and the LoRA on attention and on every expert is what one process trains on the batches
    put together (its routing the union of the ranks'); every LoRA weight has a gradient on every rank at every
    step, so optimizer state exists for each from the first step on."""
    ranks, one = runs["ranks"][f"{kind}-{layout}"], runs["one"][f"{kind}-{layout}"]
    assert _idle_on_one_busy_on_other(ranks), "every expert was busy on both ranks or on neither: no test"
    assert ranks["without_grad"] == [[], []]  # every LoRA weight had a gradient on every rank at every step
    for key, per_rank in ranks["routes"].items():
        assert set.union(*per_rank) == one["routes"][key][0], f"{key}: routed otherwise in one process"
    experts = {n for n in one["lora"] if ".experts." in n}
    attention = {n for n in one["lora"] if ".self_attn." in n}
    assert experts and attention
    if layout != "16bit":  # one LoRA per 4-bit expert and projection
        assert any(re.search(r"\.experts\.3\.", n) for n in experts)
    if layout != "4bit":  # peft's LoRA of the fused parameters
        assert any(n.endswith(("gate_up_proj.lora_B.default.weight", "experts.lora_B.default.weight"))
                   or ".experts.lora_B." in n for n in experts)
    _assert_same_lora(ranks, one)


@pytest.mark.parametrize("job", ["mixtral-4bit", "qwen3_moe-mixed", "deepseek_v3-4bit"])
def test_activation_checkpointing_and_accumulation_train_as_one_process(runs, job):
    """Routing recomputed in the backward (activation checkpointing) and two micro-batches a step: still one
    process's LoRA, with experts idle on one rank's micro-batch."""
    name = f"{job}-checkpointing-accumulation"
    ranks, one = runs["ranks"][name], runs["one"][name]
    assert _idle_on_one_busy_on_other(ranks)
    _assert_same_lora(ranks, one)


def test_lora_on_attention_alone_trains_as_one_process(runs):
    ranks, one = runs["ranks"]["mixtral-4bit-attention"], runs["one"]["mixtral-4bit-attention"]
    assert _idle_on_one_busy_on_other(ranks)
    assert {n.split(".self_attn.")[1].split(".")[0] for n in one["lora"]} == {"q_proj", "v_proj"}
    _assert_same_lora(ranks, one)


def test_targets_that_match_nothing_fail_in_one_line_on_every_rank(runs):
    errors = runs["ranks"]["mixtral-4bit-no-target"]["errors"]
    assert len(errors) == 2 and all("w9" in e and "\n" not in e.strip() for e in errors)


@pytest.mark.parametrize("kind", ROUTER_LOSS)
def test_router_loss_on_per_rank_data(runs, kind):
    """output_router_logits=True: the auxiliary loss is added to each rank's loss (the same batches without it give
    another), the steps complete on per-rank data, and the LoRA, which the auxiliary loss reaches through the hidden
    states the routers read, moves otherwise than without it."""
    with_loss, without = runs["ranks"][f"{kind}-4bit-router-loss"], runs["ranks"][f"{kind}-4bit"]
    assert _idle_on_one_busy_on_other(with_loss)
    assert all(torch.isfinite(torch.tensor(with_loss["losses"])))
    assert with_loss["losses"][0] > without["losses"][0]  # the same model and batch, plus a positive auxiliary loss
    assert with_loss["lora"].keys() == without["lora"].keys()
    assert any(not torch.equal(with_loss["lora"][n], without["lora"][n]) for n in with_loss["lora"])


# ----------------------------------------------------------------------------------------- the worker


def _routes(model) -> tuple[dict, list]:
    """Hooks recording, per MoE layer, the experts chosen for the tokens of each forward (a recomputation under
    activation checkpointing adds the same ones again)."""
    chosen: dict[int, set[int]] = {}
    hooks = []
    for name, module in model.named_modules():
        layer = re.search(r"layers\.(\d+)\.mlp\.experts$", name)
        if layer:
            def keep(_module, args, i=int(layer[1])):
                chosen.setdefault(i, set()).update(args[1].flatten().tolist())
            hooks.append(module.register_forward_pre_hook(keep))
    assert hooks, "no experts module found"
    return chosen, hooks


def _job(job: dict, rank: int, world: int) -> dict:
    import torch.distributed as dist

    import prequant
    from prequant.fsdp import lora_init_value

    try:
        model = prequant.load_for_fsdp(job["checkpoint"], lora_r=4, lora_alpha=8, seed=0, dtype=torch.float32,
                                       target_modules=job.get("targets", "all-linear"),
                                       gradient_checkpointing=job.get("gc", False))
    except Exception as e:  # noqa: BLE001 - the test reads what each rank was told
        errors = [None] * world  # a rank that did not fail would be in load_for_fsdp's collectives: the run fails
        dist.all_gather_object(errors, f"{type(e).__name__}: {e}")
        return {"errors": errors}
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    init = {n: lora_init_value(n, tuple(p.shape), 0) for n, p in trained}
    optimizer = torch.optim.SGD([p for _, p in trained], lr=LR)
    chosen, hooks = _routes(model) if job["name"] != "llama-4bit" else ({}, [])
    routes, losses, missing = {}, [], set()
    for step, micros in enumerate(job["steps"]):
        for m, batches in enumerate(micros):
            ids = torch.tensor(batches[rank]) if world == len(batches) else torch.cat([torch.tensor(b) for b in batches])
            chosen.clear()
            loss = model(input_ids=ids, labels=ids, output_router_logits=job.get("router_loss", False)).loss
            (loss / len(micros)).backward()
            losses.append(loss.item())
            gathered = [None] * world
            dist.all_gather_object(gathered, {k: set(v) for k, v in chosen.items()})
            for layer in chosen:
                routes[(step, m, layer)] = [g[layer] for g in gathered]
        missing.update(n for n, p in trained if p.grad is None)
        optimizer.step()
        optimizer.zero_grad()
    for hook in hooks:
        hook.remove()
    without = [None] * world
    dist.all_gather_object(without, sorted(missing))
    return {"lora": {n: p.full_tensor().detach().clone() for n, p in trained}, "init": init, "routes": routes,
            "losses": losses, "without_grad": without}


def _worker(spec: dict) -> None:

    records = {}
    world = int(os.environ["WORLD_SIZE"])
    for job in spec["jobs"]:
        if world == 1 and job.get("ranks_only"):
            continue
        torch.manual_seed(0)
        records[job["name"]] = _job(job, int(os.environ["RANK"]), world)
    finish_worker(records, spec["out"])


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", required=True)
    _worker(json.loads(parser.parse_args().worker))
