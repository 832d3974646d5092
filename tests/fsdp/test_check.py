"""check-fsdp on a remote-code checkpoint (the tiny Grok-1 of tests/grok/, both namings), for real on 2 gloo ranks:
`--trust-remote-code` reaches every loader, and without it the command refuses in one line before any rank starts."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from conftest import build_grok, run_cli

from prequant.fsdp.checkpoint import Checkpoint

NPROC = 2


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
    proc = run_cli("check-fsdp", str(grok), "--nproc", str(NPROC), "--steps", "3", "--seq-len", "16",
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


def test_check_fsdp_refuses_remote_code_without_the_flag(grok):
    proc = run_cli("check-fsdp", str(grok), "--nproc", str(NPROC), "--loader", "prequant")
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
    """On the GPU machine, check-fsdp failed a real-shape Grok-1 with 'packed bytes changed (0 at rest, 0 in
    forward, ...)': the experts its 16 tokens were not routed to never ran in the forward that checks their bytes."""
    report = tmp_path / "report.json"
    proc = run_cli("check-fsdp", str(grok_routed), "--nproc", str(NPROC), "--steps", "2", "--seq-len", "2",
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
    import torch

    from prequant.fsdp.report import summarize

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
