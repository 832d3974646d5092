"""FSDP+QLoRA: load_for_fsdp and check-fsdp, for real on 2 ranks (gloo on the CPU, NCCL on 2 GPUs).

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
from conftest import ROOT, build_checkpoint, read_checkpoint, run_cli

from prequant.fsdp.check import SFT_LOSS_RTOL

LORA = {"lora_r": 4, "lora_alpha": 8, "seed": 0}
BATCH = {"batch": 2, "seq": 16, "seed": 0}
# After the first step, how far SFTTrainer's loss may be from the plain loop's, as a part of what the steps changed
# (see test_check_fsdp_all_loaders_agree_on_cpu): ten times the largest gap rounding made on the CPU machine.
SFT_STEP_RTOL = 0.01


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


def _torchrun(*args: str, nproc: int = 2, timeout: float = 600, **extra_env: str) -> subprocess.CompletedProcess:
    # The worker is this very file, run as a script: it needs the checkout and the tests' own helpers (conftest).
    path = [str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), **extra_env}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                           *args], check=False, capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return proc


def _sharded(ckpt: Path, out: Path, storage: str = "uint8", **env: str) -> list[dict]:
    """Run the worker on 2 ranks; return each rank's saved state."""
    _torchrun(__file__, "--worker", str(ckpt), str(out), storage, **env)
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
    from prequant.fsdp.distributed import LAUNCHER_ENV

    for key in LAUNCHER_ENV:
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(UsageError, match=r"run the script under torchrun or accelerate launch \(also for one GPU: "
                       r"torchrun --nproc_per_node 1\), or call init_process_group first"):
        load_for_fsdp(tiny)


def test_byte_check_sees_nan_canonicalization(tiny):
    """What bitsandbytes #1945 does to bf16-stored codes (NaN words -> 0x7FFF) is counted as corruption."""
    from prequant.fsdp.job import PackedBytes

    check = PackedBytes(str(tiny), torch.device("cpu"))
    prefix = next(p for p in sorted(check.ckpt.quantized) if _nan_words(check.expected(p)).any())
    good = check.expected(prefix).clone()
    check._compare(prefix, good, "at_rest")
    bad = good.clone().view(torch.int16)
    bad[_nan_words(good)] = 0x7FFF
    check._compare(prefix, bad.view(torch.uint8), "in_forward")
    r = check.result
    check.close()
    assert r["mismatched_at_rest"] == 0 and r["nan_patterns"] >= 1
    assert r["mismatched_in_forward"] >= 1 and r["nan_canonicalized"] >= 1
    assert r["first_bad"] == [f"{prefix} (in_forward: {r['mismatched_in_forward']} bytes)"]


def _nan_words(b: torch.Tensor) -> torch.Tensor:
    w = b.view(torch.int16)
    return ((w & 0x7F80) == 0x7F80) & ((w & 0x7F) != 0) & (w != 0x7FFF)


# ----------------------------------------------------------------------------------------- 2 ranks, gloo


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


def test_forced_compat_fixes_change_nothing_on_a_torch_that_has_them(tiny, ranks, tmp_path):
    """The fixes for torch without non-float FSDP2 parameters (run for real on 2.11 by the GPU check) give, when
    forced on this torch, the same shards, bytes, loss and grads as torch's own support."""
    forced = _sharded(tiny, tmp_path, PREQUANT_TEST_FORCE_FSDP_COMPAT="1")
    for a, b in zip(ranks, forced, strict=True):
        assert a["loss"] == b["loss"] and a["in_forward_mismatched_bytes"] == b["in_forward_mismatched_bytes"] == 0
        assert a["shards"].keys() == b["shards"].keys()
        for name, (start, stop, t) in a["shards"].items():
            assert (start, stop) == b["shards"][name][:2] and torch.equal(t, b["shards"][name][2]), name
            assert t.dtype == b["shards"][name][2].dtype
        assert all(torch.equal(g, b["grads"][n]) for n, g in a["grads"].items())


@pytest.mark.slow
def test_check_fsdp_all_loaders_agree_on_cpu(tiny, tmp_path):
    report = tmp_path / "report.json"
    proc = run_cli("check-fsdp", str(tiny), "--nproc", "2", "--steps", "3", "--seq-len", "32", "--report", str(report),
                   "--loader", "transformers", "--loader", "prequant", "--loader", "trainer")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "first-step loss: " in proc.stdout and "result: ok" in proc.stdout
    r = json.loads(report.read_text())
    c = r["comparison"]
    assert r["ok"] and c["first_loss_agree"] and set(c["first_loss"]) == {"transformers", "prequant", "trainer"}
    assert c["first_loss"]["transformers"] == c["first_loss"]["prequant"]  # the model's own loss, to the bit
    for loader in ("transformers", "prequant", "trainer"):
        s = r["runs"][loader]["summary"]
        assert s["packed_intact"] and s["decreasing"] and s["grads_finite"] and s["ranks_agree"], (loader, s)
        assert s["packed_tensors"] == 14 and s["mismatched_in_forward"] == 0 and len(s["losses"]) == 3
        assert all(rank["load"]["peak_rss_anon"] > 0 for rank in r["runs"][loader]["ranks"])
    # SFTTrainer trained what the plain loop trains: the same optimizer on the same batch, so after each step the
    # losses move alike. Not to SFT_LOSS_RTOL: that bounds one forward on the same weights. The two first gradients
    # differ in their last bits (TRL's loss kernel), and AdamW's first update, lr * m / sqrt(v), turns each of those
    # into a step of almost lr wherever rounding decides a tiny gradient's sign. How much that moves later losses
    # depends on the CPU's kernels: on the CPU machine the third losses were equal to the bit with torch's AVX-512
    # kernels, 0.07-0.09% of what the steps changed apart with ATEN_CPU_CAPABILITY=default, and a CI runner's differed
    # likewise (5.436084 against 5.436144). A real difference moves them much further: a learning rate 5% higher,
    # 4.6% of the change.
    trainer, plain = r["runs"]["trainer"]["summary"]["losses"], r["runs"]["prequant"]["summary"]["losses"]
    for step in range(1, len(plain)):
        moved = abs(plain[0] - plain[step])
        assert abs(trainer[step] - plain[step]) <= SFT_STEP_RTOL * moved, (step, trainer, plain)


def test_check_fsdp_usage_errors(tiny, tmp_path):
    proc = run_cli("check-fsdp", str(tmp_path), "--nproc", "2")
    assert proc.returncode == 2
    assert proc.stderr == f"Error: {tmp_path}: no config.json; pass a directory written by prequant convert\n"
    assert proc.stdout == ""
    proc = run_cli("check-fsdp", str(tiny), "--nproc", "2", "--loader", "deepspeed")
    assert proc.returncode == 2 and "--loader 'deepspeed'" in proc.stderr
    assert proc.stderr == "Error: --loader 'deepspeed': use one of transformers, prequant, trainer\n"
    assert proc.stdout == ""


def test_check_fsdp_runs_transformers_and_prequant_by_default():
    from prequant.fsdp.check import CheckOptions

    assert CheckOptions().loaders == ("transformers", "prequant")  # trainer needs the train extra: asked by name
    assert CheckOptions(loaders=("trainer",)).loaders == ("trainer",)


def _report(**first_losses: float):
    from prequant.fsdp.check import CheckReport

    runs = {k: {"summary": {"losses": [v, v / 2], "ok": True, "problems": []}} for k, v in first_losses.items()}
    return CheckReport("ckpt", 2, runs)


def test_first_losses_are_compared_across_all_loaders():
    from prequant.fsdp.check import CheckFailed

    same = _report(transformers=5.5, prequant=5.5, trainer=5.5)
    assert same.ok and same.comparison["first_loss_equal"] and same.comparison["first_loss_agree"]
    third = _report(transformers=5.5, prequant=5.5, trainer=5.6)  # only the third differs: a pairwise check misses it
    assert not third.ok and third.comparison["first_loss_abs_diff"] == pytest.approx(0.1)
    assert "first-step losses differ by 0.1 between the loaders" in CheckFailed(third).message
    own = _report(transformers=5.5, prequant=5.5 * (1 + 1e-7))  # the model's own loss: equal to the bit, or not
    assert not own.ok and not own.comparison["first_loss_agree"]


def test_sft_first_loss_may_differ_by_float32_rounding_only():
    rounding = _report(prequant=5.51758003, trainer=5.51758003 * (1 + SFT_LOSS_RTOL / 2))
    assert rounding.ok and not rounding.comparison["first_loss_equal"] and rounding.comparison["first_loss_agree"]
    assert not _report(prequant=5.51758003, trainer=5.51758003 * (1 + 2 * SFT_LOSS_RTOL)).ok


@pytest.mark.slow
def test_example_training_script_saves_a_loadable_adapter(tiny, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = tmp_path / "adapter"
    proc = _torchrun(str(ROOT / "scripts" / "train_qlora_fsdp.py"), str(tiny), "--steps", "2", "--seq-len", "16",
                     "--lora-r", "4", "--output", str(out))
    assert "step 2/2" in proc.stderr + proc.stdout
    base = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.bfloat16)
    model = PeftModel.from_pretrained(base, out)
    b = [p for n, p in model.named_parameters() if ".lora_B." in n]
    assert b and any(p.abs().sum() > 0 for p in b)  # trained: B moved away from zero


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


def _worker(ckpt: str, out: str, storage: str) -> None:
    """One rank: load with load_for_fsdp, record what it holds, one forward/backward; save to out/rank{R}.pt."""
    import torch.distributed as dist

    import prequant.fsdp as F
    import prequant.fsdp.loader as L
    import prequant.fsdp.sharding as S
    from prequant.fsdp.job import PackedBytes

    device = F.init_distributed()
    rank = dist.get_rank()
    read = {"bytes": 0}
    original = L._read_rows

    def counting(src: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        rows = original(src, start, stop)
        read["bytes"] += rows.numel() * rows.element_size()
        return rows

    L._read_rows = counting
    if os.environ.get("PREQUANT_TEST_FORCE_FSDP_COMPAT") == "1":
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
            keys[name] = S._checkpoint_prefix(name)  # the peft name, wrappers stripped
    quant_states = {}
    for prefix, module in F.packed_layers(model):
        qs = module.quant_state
        quant_states[prefix] = {"absmax": qs.absmax.cpu(), "code": qs.code.cpu(), "nested_absmax": qs.state2.absmax.cpu(),
                                "nested_code": qs.state2.code.cpu(), "shape": tuple(qs.shape), "blocksize": qs.blocksize}
    check = PackedBytes(ckpt, device)
    batch = _batch(int(checkpoint.config["vocab_size"])).to(device)
    handles = [m.register_forward_pre_hook(lambda mod, a, p=p: check._compare(p, mod.weight, "in_forward"))
               for p, m in F.packed_layers(model)]
    loss = model(input_ids=batch, labels=batch).loss
    for h in handles:
        h.remove()
    loss.backward()
    grads = {n: p.grad.to_local().detach().cpu() for n, p in model.named_parameters() if p.grad is not None}
    param_bytes = sum(checkpoint.tensors[k].nbytes for k in set(keys.values()))
    shard_bytes = sum(s[2].numel() * s[2].element_size() for n, s in shards.items() if n in keys)
    torch.save({"keys": keys, "shards": shards, "quant_states": quant_states, "loss": loss.item(), "grads": grads,
                "bytes_read": read["bytes"], "shard_bytes": shard_bytes, "param_bytes_in_checkpoint": param_bytes,
                "in_forward_mismatched_bytes": check.result["mismatched_in_forward"]}, Path(out) / f"rank{rank}.pt")
    check.close()
    checkpoint.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", nargs=3, metavar=("CHECKPOINT", "OUT", "STORAGE"), required=True)
    _worker(*ap.parse_args().worker)
