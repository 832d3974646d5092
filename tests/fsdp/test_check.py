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
