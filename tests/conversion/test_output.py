"""Where a conversion may write: the same conversion run again says a finished output is complete, --resume only
continues an interrupted prequant conversion, an OUTPUT_DIR inside SOURCE is refused; a taken OUTPUT_DIR is refused
before torch is imported or the Hub is asked; in each refused case nothing is touched."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import cli_env, run_cli

ARGS = ("--device", "cpu")


def _snapshot(root: Path) -> dict[str, tuple[str, int]]:
    """Every file under `root`: sha256 and mtime (a rewrite with the same bytes shows too)."""
    return {
        p.relative_to(root).as_posix(): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
        for p in sorted(root.rglob("*")) if p.is_file()
    }


def _one_line_error(proc) -> str:
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), proc.stderr
    return lines[0]


@pytest.fixture
def finished(checkpoints, tmp_path) -> Path:
    """A finished conversion of the tiny Llama (NF4, the defaults)."""
    out = tmp_path / "finished"
    run_cli("convert", str(checkpoints("llama")), str(out), *ARGS, check=True)
    return out


def test_resume_into_someone_elses_checkpoint_is_refused_untouched(checkpoints, tmp_path):
    """A mistyped OUTPUT_DIR with --resume: a folder holding a user's own bf16 checkpoint."""
    theirs = Path(shutil.copytree(checkpoints("qwen2"), tmp_path / "their-model"))
    before = _snapshot(theirs)
    proc = run_cli("convert", str(checkpoints("llama")), str(theirs), *ARGS, "--resume")
    assert proc.returncode == 2
    assert "holds no interrupted conversion to resume" in _one_line_error(proc)
    assert _snapshot(theirs) == before and sorted(os.listdir(theirs)) == sorted(before)


def test_resume_into_a_finished_conversion_of_another_job_is_refused_untouched(checkpoints, finished):
    before = _snapshot(finished)
    proc = run_cli("convert", str(checkpoints("llama")), str(finished), *ARGS, "--quant-type", "fp4", "--resume")
    assert proc.returncode == 2
    assert ("holds a finished conversion with other options (--quant-type: 'nf4' there, 'fp4' here)"
            in _one_line_error(proc))
    assert _snapshot(finished) == before and sorted(os.listdir(finished)) == sorted(before)


def test_resume_of_a_finished_conversion_says_already_complete_and_writes_nothing(checkpoints, finished):
    before = _snapshot(finished)
    proc = run_cli("convert", str(checkpoints("llama")), str(finished), *ARGS, "--resume")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"already complete: {finished} holds this conversion"), proc.stdout
    assert _snapshot(finished) == before and sorted(os.listdir(finished)) == sorted(before)
    as_json = run_cli("convert", str(checkpoints("llama")), str(finished), *ARGS, "--resume", "--json")
    assert '"already_complete": true' in as_json.stdout


@pytest.mark.slow
def test_an_already_complete_run_says_no_speed(checkpoints, finished):
    """Nothing was read: a rate ("0.0 s, 67.9 GB/s of input") would be meaningless, in the text and in the JSON."""
    proc = run_cli("convert", str(checkpoints("llama")), str(finished), *ARGS)
    assert proc.returncode == 0 and proc.stdout.startswith("already complete:"), proc.stderr
    assert "time:" not in proc.stdout and "B/s" not in proc.stdout, proc.stdout
    as_json = json.loads(run_cli("convert", str(checkpoints("llama")), str(finished), *ARGS, "--json").stdout)
    assert as_json["already_complete"] is True and as_json["gb_per_s"] is None


def test_the_same_conversion_run_again_says_already_complete_and_writes_nothing(checkpoints, finished):
    """Without --resume too: a rerun of the very command that finished neither fails nor converts again."""
    before = _snapshot(finished)
    proc = run_cli("convert", str(checkpoints("llama")), str(finished), *ARGS)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"already complete: {finished} holds this conversion"), proc.stdout
    assert _snapshot(finished) == before and sorted(os.listdir(finished)) == sorted(before)


def test_a_finished_conversion_of_another_job_is_refused_without_resume_too(checkpoints, finished):
    before = _snapshot(finished)
    proc = run_cli("convert", str(checkpoints("llama")), str(finished), *ARGS, "--quant-type", "fp4")
    assert proc.returncode == 2
    assert ("holds a finished conversion with other options (--quant-type: 'nf4' there, 'fp4' here)"
            in _one_line_error(proc))
    assert _snapshot(finished) == before


@pytest.fixture
def taken(tmp_path) -> Path:
    out = tmp_path / "taken"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    return out


def test_a_taken_output_dir_is_refused_before_the_hub_is_asked(taken, tmp_path):
    """Offline, with nothing cached: the refusal is about OUTPUT_DIR, not about the Hub."""
    env = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf-home")}
    proc = run_cli("convert", "some-org/some-model", str(taken), *ARGS, env=env)
    assert proc.returncode == 2
    assert _one_line_error(proc) == (f"Error: OUTPUT_DIR {taken} is not empty (it holds notes.txt); pass --overwrite "
                                     "to replace the checkpoint in it, or choose an empty directory")


def test_a_taken_output_dir_is_refused_before_torch_is_imported(checkpoints, taken):
    code = ("import sys\n"
            f"sys.argv = ['prequant', 'convert', {str(checkpoints('llama'))!r}, {str(taken)!r}]\n"
            "from prequant import cli\n"
            "try:\n    cli.main()\nexcept SystemExit as e:\n    print(e.code, 'torch' in sys.modules)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=cli_env(), check=False)
    assert proc.stdout.split() == ["2", "False"], proc.stderr
    assert "is not empty" in proc.stderr


def test_resume_of_a_finished_conversion_with_a_file_gone_is_refused(checkpoints, finished):
    (finished / "model.safetensors").unlink()
    before = _snapshot(finished)
    proc = run_cli("convert", str(checkpoints("llama")), str(finished), *ARGS, "--resume")
    assert proc.returncode == 2
    assert "model.safetensors is missing" in _one_line_error(proc)
    assert _snapshot(finished) == before


def test_output_dir_inside_the_source_is_refused(checkpoints, tmp_path):
    src = Path(shutil.copytree(checkpoints("llama"), tmp_path / "tiny-llama"))
    before = _snapshot(src)
    for output_dir in (src / "nf4", src / "nested" / "deeper"):
        proc = run_cli("convert", str(src), str(output_dir), *ARGS)
        assert proc.returncode == 2
        line = _one_line_error(proc)
        assert "inside the source directory" in line and str(tmp_path / "tiny-llama-nf4") in line  # the fix
    assert _snapshot(src) == before and sorted(os.listdir(src)) == sorted(before)


def test_output_dir_inside_the_source_through_a_link_is_refused(checkpoints, tmp_path):
    src = Path(shutil.copytree(checkpoints("llama"), tmp_path / "tiny-llama"))
    (tmp_path / "link").symlink_to(src)
    proc = run_cli("convert", str(src), str(tmp_path / "link" / "nf4"), *ARGS)
    assert proc.returncode == 2 and "inside the source directory" in _one_line_error(proc)
    assert not (src / "nf4").exists()
