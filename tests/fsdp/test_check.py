"""scripts/bench/check_fsdp.py (transformers' FSDP+QLoRA path against load_for_fsdp), for real on 2 gloo ranks: a tiny
Llama with every loader, and a remote-code checkpoint (the tiny Grok-1 of tests/grok/, both namings), where
`--trust-remote-code` reaches every loader and without it the script refuses in one line before any rank starts."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import ROOT, build_checkpoint, build_grok

from prequant.fsdp import Checkpoint

NPROC = 2
SCRIPT = ROOT / "scripts" / "bench" / "check_fsdp.py"
_spec = importlib.util.spec_from_file_location("check_fsdp", SCRIPT)
bench = sys.modules["check_fsdp"] = importlib.util.module_from_spec(_spec)  # the script's functions, imported
_spec.loader.exec_module(bench)
# After the first step, how far SFTTrainer's loss may be from the plain loop's, as a part of what the steps changed
# (see test_check_fsdp_all_loaders_agree_on_cpu): ten times the largest gap rounding made on the CPU machine.
SFT_STEP_RTOL = 0.01


def _check(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=1800,
                          check=False)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """A tiny Llama converted by prequant (NF4, double quant, bf16 storage)."""
    import prequant

    src = build_checkpoint("llama", tmp_path_factory.mktemp("check-src"))
    out = tmp_path_factory.mktemp("check") / "nf4"
    prequant.convert(src, out, device="cpu", progress=False)
    return out


@pytest.fixture(scope="module", params=["keyfan", "hpcai"])
def grok(request, tmp_path_factory) -> Path:
    import prequant

    base = tmp_path_factory.mktemp(f"check-grok-{request.param}")
    src = build_grok(base / f"grok-{request.param}-src", request.param, experts_per_token=4)
    out = base / f"grok-{request.param}-nf4"  # distinct names: transformers caches remote code by directory name
    prequant.convert(src, out, device="cpu", progress=False)
    return out


def _weights(ckpt: Path) -> tuple[int, int]:
    """(bytes of every parameter the checkpoint holds, bytes of its packed 4-bit weights); quant states aside."""
    c = Checkpoint(ckpt)
    try:
        params = sum(r.nbytes for n, r in c.tensors.items() if n.endswith((".weight", ".bias")))
        packed = sum(c.tensors[f"{prefix}.weight"].nbytes for prefix in c.quantized)
        return params, packed
    finally:
        c.close()


@pytest.mark.slow
def test_check_fsdp_trains_a_remote_code_grok_with_every_loader(grok, tmp_path):
    loaders = ["prequant", "trainer"] + (["transformers"] if "keyfan" in grok.name else [])  # one naming is enough
    report = tmp_path / "report.json"
    proc = _check(str(grok), "--nproc", str(NPROC), "--steps", "3", "--seq-len", "16",
                   "--trust-remote-code", "--report", str(report), *(a for x in loaders for a in ("--loader", x)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "result: ok" in proc.stdout
    r = json.loads(report.read_text())
    assert r["ok"] and r["comparison"]["first_loss_agree"] and set(r["runs"]) == set(loaders)
    params, packed = _weights(grok)
    for loader in loaders:
        run = r["runs"][loader]
        assert run["options"]["trust_remote_code"] is True
        s = run["summary"]
        assert s["packed_intact"] and s["grads_finite"] and s["ranks_agree"], (loader, s)
        assert s["packed_tensors"] == 32 and s["mismatched_at_rest"] == s["mismatched_in_forward"] == 0
        for rank in run["ranks"]:
            losses = rank["losses"]
            assert len(losses) == 3 and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], (loader, rank)
            assert rank["packed"]["bytes"] == packed  # every packed weight's bytes checked, on every rank
        held = [rank["load"]["checkpoint_bytes_held"] for rank in run["ranks"]]
        if loader == "transformers":
            assert held == [None] * NPROC  # FSDP1 flattens the parameters: not measured
            continue
        assert sum(held) == params  # the shards tile the checkpoint's parameters once ...
        assert all(abs(h - params / NPROC) <= 0.05 * params / NPROC for h in held), held  # ... each rank about 1/N


@pytest.mark.slow
def test_check_fsdp_refuses_remote_code_without_the_flag(grok):
    proc = _check(str(grok), "--nproc", str(NPROC), "--loader", "prequant")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == (f"Error: {grok}: its model is the checkpoint's own code "
                           "(modeling_grok1.Grok1ModelForCausalLM); pass --trust-remote-code to run it\n")


@pytest.fixture(scope="module")
def grok_routed(tmp_path_factory) -> Path:
    """The tiny Grok-1 with one of its four experts per token: a batch of two tokens runs at most two experts of a
    layer, so the others never run, as most of Grok-1's eight experts did on a batch of 16 tokens."""
    import prequant

    base = tmp_path_factory.mktemp("check-grok-routed")
    src = build_grok(base / "grok-routed-src", "keyfan", experts_per_token=1)
    out = base / "grok-routed-nf4"
    prequant.convert(src, out, device="cpu", progress=False)
    return out


@pytest.mark.slow
def test_experts_no_token_was_routed_to_are_checked_at_rest_not_failed(grok_routed, tmp_path):
    """The experts no token of the batch was routed to never run in the forward that checks their bytes: they are
    checked at rest and counted, not reported as changed bytes."""
    report = tmp_path / "report.json"
    proc = _check(str(grok_routed), "--nproc", str(NPROC), "--steps", "2", "--seq-len", "2",
                   "--batch-size", "1", "--trust-remote-code", "--loader", "prequant", "--report", str(report))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    s = json.loads(report.read_text())["runs"]["prequant"]["summary"]
    assert s["packed_intact"] and s["mismatched_at_rest"] == s["mismatched_in_forward"] == 0
    # two layers, at least two of four experts not routed in each, three linear layers an expert
    unrouted = s["experts_not_routed"]
    assert unrouted >= 12 and s["checked_in_forward"] == s["packed_tensors"] - unrouted
    assert f"{unrouted} experts no token was routed to, checked at rest only" in proc.stdout


def _rank(not_in_forward: list[str], losses: tuple[float, ...] = (2.0, 1.5)) -> dict:
    """One rank's figures as the job reports them, all in order but the layers that did not run."""
    phase = {"seconds": 1.0, "peak_gpu_allocated": 0, "peak_rss_anon": 0, "peak_rss_file": 0}
    packed = {"tensors": 4, "bytes": 64, "nan_patterns": 0, "mismatched_at_rest": 0, "mismatched_in_forward": 0,
              "nan_canonicalized": 0, "checked_in_forward": 4 - len(not_in_forward), "not_in_forward": not_in_forward,
              "first_bad": []}
    return {"losses": list(losses), "grads_finite": True, "packed": packed, "load": phase, "train": phase}


def test_a_layer_that_is_no_expert_missing_from_the_forward_is_a_problem():
    summarize = bench.summarize
    limits = {"gpu_load": 1, "rss_anon": 1, "largest_layer": 1, "checkpoint": 1}
    cpu = torch.device("cpu")
    routed = summarize("prequant", [_rank(["transformer.decoder_layer.0.moe.3.linear"])], limits, cpu)
    assert routed["ok"] and routed["experts_not_routed"] == 1
    missed = summarize("prequant", [_rank(["model.layers.0.self_attn.q_proj"])], limits, cpu)
    assert not missed["ok"] and missed["packed_intact"]  # its bytes were right at rest: only unchecked in forward
    assert missed["problems"] == ["1 packed layers never ran in the forward pass that checks their bytes (e.g. "
                                  "model.layers.0.self_attn.q_proj): checked at rest only"]
    one = summarize("prequant", [_rank([], losses=(2.0,))], limits, cpu)
    assert one["problems"] == ["one step only: a loss cannot be seen to decrease (run --steps 2 or more)"]


def test_byte_check_sees_nan_canonicalization(tiny):
    """What bitsandbytes #1945 does to bf16-stored codes (NaN words -> 0x7FFF) is counted as corruption."""
    check = bench.PackedBytes(str(tiny), torch.device("cpu"))
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


@pytest.mark.slow
def test_check_fsdp_all_loaders_agree_on_cpu(tiny, tmp_path):
    report = tmp_path / "report.json"
    proc = _check(str(tiny), "--nproc", "2", "--steps", "3", "--seq-len", "32", "--report", str(report),
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
    # losses move alike. Not to bench.SFT_LOSS_RTOL: that bounds one forward on the same weights. The two first gradients
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
    proc = _check(str(tmp_path), "--nproc", "2")
    assert proc.returncode == 2
    assert proc.stderr == f"Error: {tmp_path}: no config.json; pass a directory written by prequant convert\n"
    assert proc.stdout == ""
    proc = _check(str(tiny), "--nproc", "2", "--loader", "deepspeed")
    assert proc.returncode == 2 and "--loader 'deepspeed'" in proc.stderr
    assert proc.stderr == "Error: --loader 'deepspeed': use one of transformers, prequant, trainer\n"
    assert proc.stdout == ""


def test_check_fsdp_runs_transformers_and_prequant_by_default():
    assert bench.options(["ckpt"]).loaders == ("transformers", "prequant")  # trainer needs the train extra
    assert bench.options(["ckpt", "--loader", "trainer"]).loaders == ("trainer",)


def _report(**first_losses: float):
    runs = {k: {"summary": {"losses": [v, v / 2], "ok": True, "problems": []}} for k, v in first_losses.items()}
    return bench.CheckReport("ckpt", 2, runs)


def test_first_losses_are_compared_across_all_loaders():
    same = _report(transformers=5.5, prequant=5.5, trainer=5.5)
    assert same.ok and same.comparison["first_loss_equal"] and same.comparison["first_loss_agree"]
    third = _report(transformers=5.5, prequant=5.5, trainer=5.6)  # only the third differs: a pairwise check misses it
    assert not third.ok and third.comparison["first_loss_abs_diff"] == pytest.approx(0.1)
    assert "first-step losses differ by 0.1 between the loaders" in bench.failures(third)
    own = _report(transformers=5.5, prequant=5.5 * (1 + 1e-7))  # the model's own loss: equal to the bit, or not
    assert not own.ok and not own.comparison["first_loss_agree"]


def test_sft_first_loss_may_differ_by_float32_rounding_only():
    rounding = _report(prequant=5.51758003, trainer=5.51758003 * (1 + bench.SFT_LOSS_RTOL / 2))
    assert rounding.ok and not rounding.comparison["first_loss_equal"] and rounding.comparison["first_loss_agree"]
    assert not _report(prequant=5.51758003, trainer=5.51758003 * (1 + 2 * bench.SFT_LOSS_RTOL)).ok
