"""FSDP+QLoRA: load_for_fsdp, for real on 2 ranks (gloo on the CPU, NCCL on 2 GPUs).

The distributed part runs this very file under torchrun as a worker (`python -m torch.distributed.run
--nproc_per_node 2 tests/fsdp/test_fsdp.py --worker ...`): each rank loads a tiny converted checkpoint with
load_for_fsdp and saves what it holds (its rows of every parameter, its quant states, its loss and LoRA
grads after one step); the tests then put the shards together and compare them with the checkpoint.

    python -m pytest -q tests/fsdp/test_fsdp.py            # CPU (gloo)
    python -m pytest -q -m gpu tests/fsdp/test_fsdp.py     # 2 GPUs (NCCL)
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import ROOT, build_checkpoint, read_checkpoint

LORA = {"lora_r": 4, "lora_alpha": 8, "seed": 0}
BATCH = {"batch": 2, "seq": 16, "seed": 0}


def _batch(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (BATCH["batch"], BATCH["seq"]), generator=torch.Generator().manual_seed(BATCH["seed"]))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """A tiny Llama converted by prequant (NF4, double quant, bf16 storage)."""
    import prequant

    src = build_checkpoint("llama", tmp_path_factory.mktemp("fsdp-src"))
    out = tmp_path_factory.mktemp("fsdp") / "nf4"
    prequant.convert(src, out, device="cpu", progress=False)
    return out


def _torchrun(*args: str, nproc: int = 2, timeout: float = 600) -> subprocess.CompletedProcess:
    # The worker is this very file, run as a script: it needs the checkout and the tests' own helpers (conftest).
    path = [str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                           *args], check=False, capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return proc


def _sharded(ckpt: Path, out: Path, storage: str = "uint8", force_compat: bool = False) -> list[dict]:
    """Run the worker on 2 ranks; return each rank's saved state."""
    _torchrun(__file__, "--worker", str(ckpt), str(out), storage, *(["--force-compat"] if force_compat else []))
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.fixture(scope="module")
def ranks(tiny, tmp_path_factory) -> list[dict]:
    return _sharded(tiny, tmp_path_factory.mktemp("ranks"))


def _whole(ranks: list[dict], name: str) -> torch.Tensor:
    """A parameter put back together from the ranks' rows, which must tile it exactly once."""
    parts = sorted((r["shards"][name] for r in ranks), key=lambda s: s[0])
    assert parts[0][0] == 0 and all(a[1] == b[0] for a, b in itertools.pairwise(parts)), (name, [p[:2] for p in parts])
    return torch.cat([p[2] for p in parts])


def _reference_loss(ckpt: Path, device: str = "cpu") -> tuple[float, torch.nn.Module]:
    """transformers + peft on one device, unsharded, same LoRA init and batch."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from prequant.fsdp import init_lora_weights, lora_config

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16, device_map=device)
    model = get_peft_model(model, lora_config(LORA["lora_r"], LORA["lora_alpha"], 0.0, "all-linear"))
    init_lora_weights(model, LORA["seed"])
    model.train()
    batch = _batch(model.config.vocab_size).to(device)
    return model(input_ids=batch, labels=batch).loss.item(), model


# ----------------------------------------------------------------------------------------- pure parts


@pytest.mark.parametrize("rows", [0, 1, 5, 8, 13, 1024, 1025])
@pytest.mark.parametrize("size", [1, 2, 3, 4, 8])
def test_shard_rows_follow_torch_chunk(rows, size):
    from prequant.fsdp import shard_rows

    chunks = torch.arange(rows).chunk(size) if rows else ()
    for coord in range(size):
        start, stop = shard_rows(rows, coord, size)
        expected = chunks[coord].tolist() if coord < len(chunks) else []
        assert list(range(start, stop)) == expected


def test_lora_init_is_deterministic_per_name_and_seed():
    from prequant.fsdp import lora_init_value

    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"
    a = lora_init_value(name, (4, 64), 0)
    assert torch.equal(a, lora_init_value(name, (4, 64), 0))
    assert not torch.equal(a, lora_init_value(name, (4, 64), 1))
    assert not torch.equal(a, lora_init_value(name.replace("q_proj", "k_proj"), (4, 64), 0))
    assert a.dtype == torch.float32 and 0 < a.abs().max() <= 1 / 8
    assert not lora_init_value(name.replace("lora_A", "lora_B"), (64, 4), 0).any()


def test_checkpoint_without_4bit_config_is_refused(tmp_path):
    import prequant
    from prequant.fsdp import Checkpoint

    src = build_checkpoint("llama", tmp_path / "src")
    with pytest.raises(prequant.PrequantError, match="no bitsandbytes 4-bit quantization_config"):
        Checkpoint(src)


def test_load_for_fsdp_outside_a_launcher_says_how_to_run_it(tiny, monkeypatch):
    from prequant.errors import UsageError
    from prequant.fsdp import load_for_fsdp
    from prequant.fsdp.loader import LAUNCHER_ENV

    for key in LAUNCHER_ENV:
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(UsageError, match=r"run the script under torchrun or accelerate launch \(also for one GPU: "
                       r"torchrun --nproc_per_node 1\), or call init_process_group first"):
        load_for_fsdp(tiny)


# ----------------------------------------------------------------------------------------- 2 ranks, gloo


@pytest.mark.slow
def test_shards_put_together_are_the_checkpoint_bytes(tiny, ranks):
    ckpt = read_checkpoint(tiny)
    keys = ranks[0]["keys"]
    assert {keys[n] for n in keys} == {k for k in ckpt if ".weight." not in k}  # every tensor, companions aside
    for name, key in keys.items():
        got, want = _whole(ranks, name), ckpt[key]  # packed: uint8 rows of the bf16-stored bytes
        assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), key


def test_each_rank_reads_only_its_rows(ranks):
    total = sum(r["bytes_read"] for r in ranks)
    assert total == ranks[0]["param_bytes_in_checkpoint"]
    assert all(r["bytes_read"] == r["shard_bytes"] for r in ranks)
    assert all(r["bytes_read"] < 0.6 * total for r in ranks)


def test_packed_weights_are_uint8_shards_of_their_bytes(ranks):
    packed = [n for n in ranks[0]["keys"] if n.endswith("base_layer.weight")]
    assert len(packed) == 14
    assert all(ranks[0]["shards"][n][2].dtype == torch.uint8 for n in packed)


def test_quant_states_are_complete_on_every_rank(tiny, ranks):
    ckpt = read_checkpoint(tiny)
    for r in ranks:
        assert len(r["quant_states"]) == 14
        for prefix, qs in r["quant_states"].items():
            assert torch.equal(qs["absmax"], ckpt[f"{prefix}.weight.absmax"])
            assert torch.equal(qs["code"], ckpt[f"{prefix}.weight.quant_map"])
            assert torch.equal(qs["nested_absmax"], ckpt[f"{prefix}.weight.nested_absmax"])
            assert torch.equal(qs["nested_code"], ckpt[f"{prefix}.weight.nested_quant_map"])
            meta = json.loads(bytes(ckpt[f"{prefix}.weight.quant_state.bitsandbytes__nf4"].tolist()))
            assert qs["shape"] == tuple(meta["shape"]) and qs["blocksize"] == meta["blocksize"]


def test_lora_shards_are_the_seeded_init(ranks):
    from prequant.fsdp import lora_init_value

    lora = [n for n in ranks[0]["shards"] if ".lora_" in n]
    assert len(lora) == 28
    for name in lora:
        whole = _whole(ranks, name)
        assert torch.equal(whole, lora_init_value(name, tuple(whole.shape), LORA["seed"])), name


def test_first_step_loss_equals_unsharded_transformers_peft(tiny, ranks):
    loss, _ = _reference_loss(tiny)
    assert ranks[0]["loss"] == ranks[1]["loss"] == loss


@pytest.mark.slow
def test_tied_embeddings_are_sharded_once(tmp_path):
    import prequant

    src = build_checkpoint("llama_tied", tmp_path / "src")
    ckpt = tmp_path / "nf4"
    prequant.convert(src, ckpt, device="cpu", progress=False)
    ranks = _sharded(ckpt, tmp_path)
    assert "lm_head.weight" not in read_checkpoint(ckpt)
    assert not any("lm_head" in n for n in ranks[0]["shards"])  # the head is the embedding's parameter
    assert torch.equal(_whole(ranks, "base_model.model.model.embed_tokens.weight"),
                       read_checkpoint(ckpt)["model.embed_tokens.weight"])
    assert ranks[0]["loss"] == _reference_loss(ckpt)[0]


def test_lora_grads_are_finite_and_flow(ranks):
    for r in ranks:
        grads = r["grads"]
        assert len(grads) == 28 and all(torch.isfinite(g).all() for g in grads.values())
    # B starts at zero, so only B gets a gradient on the first step; it must not be all zero.
    assert any(g.abs().sum() > 0 for r in ranks for n, g in r["grads"].items() if ".lora_B." in n)


def test_compat_parameter_defaults_requires_grad_by_dtype():
    from prequant.fsdp.compat import _nn_with_nonfloat_parameters

    nn = _nn_with_nonfloat_parameters(torch.nn)
    packed = nn.Parameter(torch.zeros(4, 1, dtype=torch.uint8))
    weight = nn.Parameter(torch.zeros(4, 1, dtype=torch.bfloat16))
    assert type(packed) is torch.nn.Parameter and not packed.requires_grad and packed.dtype == torch.uint8
    assert type(weight) is torch.nn.Parameter and weight.requires_grad
    assert not nn.Parameter(torch.zeros(2), requires_grad=False).requires_grad  # an explicit flag wins
    assert nn.Module is torch.nn.Module and _nn_with_nonfloat_parameters(nn) is nn  # the rest is torch.nn; idempotent
    with pytest.raises(RuntimeError, match="floating point"):  # what torch itself does, and the proxy avoids
        torch.nn.Parameter(torch.zeros(4, 1, dtype=torch.uint8))


@pytest.mark.slow
def test_forced_compat_fixes_change_nothing_on_a_torch_that_has_them(tiny, ranks, tmp_path):
    """The fixes for torch without non-float FSDP2 parameters (run for real on 2.11 by the GPU check) give, when
    forced on this torch, the same shards, bytes, loss and grads as torch's own support."""
    forced = _sharded(tiny, tmp_path, force_compat=True)
    for a, b in zip(ranks, forced, strict=True):
        assert a["loss"] == b["loss"] and a["in_forward_mismatched_bytes"] == b["in_forward_mismatched_bytes"] == 0
        assert a["shards"].keys() == b["shards"].keys()
        for name, (start, stop, t) in a["shards"].items():
            assert (start, stop) == b["shards"][name][:2] and torch.equal(t, b["shards"][name][2]), name
            assert t.dtype == b["shards"][name][2].dtype
        assert all(torch.equal(g, b["grads"][n]) for n, g in a["grads"].items())


# ----------------------------------------------------------------------------------------- 2 GPUs, NCCL


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_gpu_shards_bytes_and_first_loss(tiny, tmp_path):
    ranks = _sharded(tiny, tmp_path)
    ckpt = read_checkpoint(tiny)
    for name, key in ranks[0]["keys"].items():
        assert torch.equal(_whole(ranks, name).reshape(-1).view(torch.uint8), ckpt[key].reshape(-1).view(torch.uint8))
    assert all(r["in_forward_mismatched_bytes"] == 0 for r in ranks)
    loss, _ = _reference_loss(tiny, "cuda:0")
    assert ranks[0]["loss"] == ranks[1]["loss"] == loss


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.xfail(reason="bitsandbytes #1945: FSDP2 gathers bf16-stored codes through a float copy that "
                   "canonicalizes NaN words; load_for_fsdp holds them as uint8 instead", strict=False)
def test_gpu_bf16_packed_storage_survives_fsdp2_forward(tiny, tmp_path):
    ranks = _sharded(tiny, tmp_path, storage="checkpoint")
    assert all(r["in_forward_mismatched_bytes"] == 0 for r in ranks)


# ----------------------------------------------------------------------------------------- the worker


def _worker(ckpt: str, out: str, storage: str, force_compat: bool) -> None:
    """One rank: load with load_for_fsdp, record what it holds, one forward/backward; save to out/rank{R}.pt."""
    import torch.distributed as dist

    import prequant.fsdp as F
    import prequant.fsdp.loader as L
    device = F.init_distributed()
    rank = dist.get_rank()
    read = {"bytes": 0}
    original = L._read_rows

    def counting(src: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        rows = original(src, start, stop)
        read["bytes"] += rows.numel() * rows.element_size()
        return rows

    L._read_rows = counting
    if force_compat:
        from prequant.fsdp.compat import ensure_nonfloat_params

        assert ensure_nonfloat_params(force=True) == ["sharded_param", "param_dtype"]
    model = F.load_for_fsdp(ckpt, lora_r=LORA["lora_r"], lora_alpha=LORA["lora_alpha"], seed=LORA["seed"],
                            device=device, packed_storage=storage)
    checkpoint = F.Checkpoint(ckpt)
    shards, keys = {}, {}
    for name, p in model.named_parameters():
        start, stop = F.local_rows(p)
        shards[name] = (start, stop, p.to_local().detach().cpu().clone())
        if ".lora_" not in name:
            keys[name] = L._checkpoint_prefix(name)  # the peft name, wrappers stripped
    quant_states = {}
    for prefix, module in F.packed_layers(model):
        qs = module.quant_state
        quant_states[prefix] = {"absmax": qs.absmax.cpu(), "code": qs.code.cpu(), "nested_absmax": qs.state2.absmax.cpu(),
                                "nested_code": qs.state2.code.cpu(), "shape": tuple(qs.shape), "blocksize": qs.blocksize}
    mismatched = {"bytes": 0}

    def compare(prefix: str, weight: torch.Tensor) -> None:  # the unsharded weight bitsandbytes gets in forward
        want = checkpoint.view(prefix + ".weight").reshape(-1).view(torch.uint8).to(device)
        mismatched["bytes"] += int((weight.detach().reshape(-1).view(torch.uint8) != want).sum())

    batch = _batch(int(checkpoint.config["vocab_size"])).to(device)
    handles = [m.register_forward_pre_hook(lambda mod, a, p=p: compare(p, mod.weight)) for p, m in F.packed_layers(model)]
    loss = model(input_ids=batch, labels=batch).loss
    for h in handles:
        h.remove()
    loss.backward()
    grads = {n: p.grad.to_local().detach().cpu() for n, p in model.named_parameters() if p.grad is not None}
    param_bytes = sum(checkpoint.tensors[k].nbytes for k in set(keys.values()))
    shard_bytes = sum(s[2].numel() * s[2].element_size() for n, s in shards.items() if n in keys)
    torch.save({"keys": keys, "shards": shards, "quant_states": quant_states, "loss": loss.item(), "grads": grads,
                "bytes_read": read["bytes"], "shard_bytes": shard_bytes, "param_bytes_in_checkpoint": param_bytes,
                "in_forward_mismatched_bytes": mismatched["bytes"]}, Path(out) / f"rank{rank}.pt")
    checkpoint.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", nargs=3, metavar=("CHECKPOINT", "OUT", "STORAGE"), required=True)
    ap.add_argument("--force-compat", action="store_true", help="apply prequant.fsdp.compat's fixes on any torch")
    a = ap.parse_args()
    _worker(*a.worker, a.force_compat)
