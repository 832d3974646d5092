"""One conversion per OUTPUT_DIR: a second one is refused naming the first while it runs (frozen for real with
SIGSTOP in the middle of its pipeline), a lock left by a killed run never blocks, nothing of the lock is
published."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import time
from pathlib import Path

import pytest
from helpers import run_cli, start_cli

ARGS = ("--device", "cpu", "--max-shard-size", "60KB")
LOCK = ".prequant.lock"


def _hashes(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rpartition(")")[2].split()[0]


@pytest.fixture(scope="module")
def source(checkpoints) -> Path:
    return checkpoints("llama")


@pytest.fixture(scope="module")
def clean(source, tmp_path_factory) -> dict[str, str]:
    out = tmp_path_factory.mktemp("lock-clean") / "out"
    run_cli("convert", str(source), str(out), *ARGS, check=True)
    return _hashes(out)


@pytest.fixture
def frozen(source, tmp_path):
    """A conversion stopped (SIGSTOP, sent by itself) after its third tensor: it holds the lock, mid-pipeline."""
    out = tmp_path / "out"
    proc = start_cli("convert", str(source), str(out), *ARGS, env={"PREQUANT_FAILPOINT": "step-journaled:3:SIGSTOP"})
    deadline = time.monotonic() + 300
    while _state(proc.pid) != "T":
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.02)
    try:
        yield proc, out
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            proc.communicate(timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("flags", [(), ("--overwrite",), ("--resume",)], ids=["plain", "overwrite", "resume"])
def test_second_conversion_is_refused_naming_the_first(source, frozen, flags):
    first, out = frozen
    staged = _hashes(out / ".prequant-staging")
    proc = run_cli("convert", str(source), str(out), *ARGS, *flags)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"Error: OUTPUT_DIR {out} is in use by another prequant "
                                                   f"conversion (pid {first.pid} on this host"), proc.stderr
    assert _hashes(out / ".prequant-staging") == staged  # the first one's work untouched


@pytest.mark.slow
def test_first_conversion_then_finishes_as_if_alone(source, clean, frozen):
    first, out = frozen
    assert run_cli("convert", str(source), str(out), *ARGS).returncode == 1  # refused while it is stopped
    first.send_signal(signal.SIGCONT)
    _, stderr = first.communicate(timeout=300)
    assert first.returncode == 0, stderr
    assert _hashes(out) == clean  # no lock file, nothing of the refused run
    report = run_cli("verify", str(out), "--json")
    assert report.returncode == 0 and json.loads(report.stdout)["files"]["extra"] == 0


def test_dry_run_takes_no_lock(source, frozen):
    _, out = frozen
    proc = run_cli("convert", str(source), str(out), *ARGS, "--dry-run")
    assert proc.returncode == 0, proc.stderr


def test_lock_of_a_killed_run_does_not_block(source, clean, tmp_path):
    out = tmp_path / "out"
    killed = run_cli("convert", str(source), str(out), *ARGS, env={"PREQUANT_FAILPOINT": "step-journaled:3"})
    assert killed.returncode == -signal.SIGKILL
    left = json.loads((out / LOCK).read_text())  # stale: its holder is gone, and so is the kernel's lock
    assert left["host"] and "convert" in left["command"]
    with pytest.raises(ProcessLookupError):
        os.kill(left["pid"], 0)
    resumed = run_cli("convert", str(source), str(out), *ARGS, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert _hashes(out) == clean and not (out / LOCK).exists()
