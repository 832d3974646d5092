"""Interrupted conversions: killed for real at chosen points, continued by the same command (or with --resume),
compared by sha256 to a clean run; another job's interrupted work is refused unless --overwrite."""

from __future__ import annotations

import hashlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import ROOT, build_checkpoint, run_cli

ARGS = ("--device", "cpu", "--max-shard-size", "60KB")


def _hashes(out: Path) -> dict[str, str]:
    return {
        p.relative_to(out).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(out.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return build_checkpoint("llama", tmp_path_factory.mktemp("resume-src"))


@pytest.fixture(scope="module")
def clean(source, tmp_path_factory):
    out = tmp_path_factory.mktemp("resume-clean") / "out"
    run_cli("convert", str(source), str(out), *ARGS, check=True)
    assert len(list(out.glob("*.safetensors"))) >= 2, "the test needs several shards"
    return _hashes(out)


def _looks_like_checkpoint(out: Path) -> bool:
    return (out / "config.json").exists() or any(out.glob("*.safetensors")) or (out / "model.safetensors.index.json").exists()


@pytest.mark.slow
@pytest.mark.parametrize(
    "failpoint",
    [
        "tensor-written:4",  # during a shard, half-way through one tensor's entries
        "step-journaled:3",  # during a shard, between two tensors
        "shard-journaled:1",  # between shards
        "shard-finalize:2",  # during a shard's finalize (blobs written, header not yet)
        "publish-file:2",  # during publishing, some files moved into place already
    ],
)
def test_sigkill_then_resume_gives_identical_files(source, clean, tmp_path, failpoint):
    out = tmp_path / "out"
    killed = run_cli("convert", str(source), str(out), *ARGS, env={"PREQUANT_FAILPOINT": failpoint})
    assert killed.returncode == -signal.SIGKILL
    if not failpoint.startswith("publish"):
        assert not _looks_like_checkpoint(out)
    resumed = run_cli("convert", str(source), str(out), *ARGS, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert _hashes(out) == clean


@pytest.mark.slow
@pytest.mark.parametrize("failpoint", ["step-journaled:3", "shard-journaled:1", "publish-file:2"])
def test_the_same_command_run_again_continues_the_interrupted_run(source, clean, tmp_path, failpoint):
    """No --resume: the staging folder of the same job is continued, not thrown away, and the run says so."""
    out = tmp_path / "out"
    killed = run_cli("convert", str(source), str(out), *ARGS, env={"PREQUANT_FAILPOINT": failpoint})
    assert killed.returncode == -signal.SIGKILL
    again = run_cli("convert", str(source), str(out), *ARGS)
    assert again.returncode == 0, again.stderr
    if not failpoint.startswith("publish"):
        done = re.search(r"^prequant: resuming: (\d+) of (\d+) tensors done$", again.stderr, re.MULTILINE)
        assert done is not None, again.stderr
        assert 0 < int(done[1]) < int(done[2])
    assert _hashes(out) == clean


@pytest.mark.slow
def test_another_jobs_interrupted_run_is_refused_unless_overwrite(source, tmp_path):
    out, fp4 = tmp_path / "out", tmp_path / "fp4"
    run_cli("convert", str(source), str(out), *ARGS, env={"PREQUANT_FAILPOINT": "step-journaled:3"})
    staged = _hashes(out / ".prequant-staging")
    proc = run_cli("convert", str(source), str(out), *ARGS, "--quant-type", "fp4")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"Error: OUTPUT_DIR {out} holds an interrupted conversion of "
                                                   "another job (the options changed"), proc.stderr
    assert "--overwrite" in lines[0]
    assert _hashes(out / ".prequant-staging") == staged
    replaced = run_cli("convert", str(source), str(out), *ARGS, "--quant-type", "fp4", "--overwrite")
    assert replaced.returncode == 0, replaced.stderr
    assert "resuming" not in replaced.stderr
    run_cli("convert", str(source), str(fp4), *ARGS, "--quant-type", "fp4", check=True)
    assert _hashes(out) == _hashes(fp4)


def test_two_clean_runs_are_byte_identical(source, clean, tmp_path):
    run_cli("convert", str(source), str(tmp_path / "again"), *ARGS, check=True)
    assert _hashes(tmp_path / "again") == clean


def test_resume_refuses_changed_options(source, tmp_path):
    out = tmp_path / "out"
    run_cli("convert", str(source), str(out), *ARGS, env={"PREQUANT_FAILPOINT": "step-journaled:3"})
    proc = run_cli("convert", str(source), str(out), *ARGS, "--quant-type", "fp4", "--resume")
    assert proc.returncode == 2
    assert "the options changed" in proc.stderr and "--overwrite" in proc.stderr
    assert not _looks_like_checkpoint(out)


def test_resume_refuses_changed_source(tmp_path):
    src = build_checkpoint("llama", tmp_path / "src")
    out = tmp_path / "out"
    run_cli("convert", str(src), str(out), *ARGS, env={"PREQUANT_FAILPOINT": "step-journaled:3"})
    shard = src / "model.safetensors"
    os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 10**9))
    proc = run_cli("convert", str(src), str(out), *ARGS, "--resume")
    assert proc.returncode == 2
    assert "the source files changed" in proc.stderr


def test_resume_without_previous_run_starts_fresh(source, clean, tmp_path):
    run_cli("convert", str(source), str(tmp_path / "out"), *ARGS, "--resume", check=True)
    assert _hashes(tmp_path / "out") == clean


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_stops_cleanly_and_says_how_to_resume(tmp_path, sig):
    from helpers import model_config  # noqa: F401 - a bigger model so the run is still going when signalled
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    src = tmp_path / "src"
    torch.manual_seed(1)
    cfg = LlamaConfig(hidden_size=512, intermediate_size=1536, num_hidden_layers=12, num_attention_heads=8, vocab_size=512)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(src)
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "prequant", "convert", str(src), str(out), "--device", "cpu", "--max-shard-size", "2MB"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    journal = out / ".prequant-staging" / "journal.jsonl"
    deadline = time.monotonic() + 120
    while not (journal.exists() and journal.stat().st_size > 0) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.01)
    proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig, stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("Error: interrupted") and "run the same command again" in last and "--resume" not in last
    assert "Traceback" not in stderr
    assert not _looks_like_checkpoint(out)
    subprocess.run([*cmd, "--resume"], env=env, check=True, capture_output=True)
    clean = tmp_path / "clean"
    subprocess.run([*cmd[:5], str(clean), *cmd[6:]], env=env, check=True, capture_output=True)
    assert _hashes(out) == _hashes(clean)
