"""The command line as a user meets it: exit codes, one-line errors, stdout results."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import cli_env, run_cli


def _one_line_error(proc) -> str:
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("Error: ")
    assert "Traceback" not in proc.stderr
    return lines[0]


def test_convert_prints_summary_on_stdout(checkpoints, tmp_path):
    proc = run_cli("convert", str(checkpoints("llama")), str(tmp_path / "out"), "--device", "cpu", "--json")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["tensors_quantized"] == 14 and summary["tensors_kept"] == 7
    assert summary["output_bytes"] == sum(p.stat().st_size for p in (tmp_path / "out").glob("*.safetensors"))


def test_dry_run_json_is_the_plan(checkpoints, tmp_path):
    proc = run_cli("convert", str(checkpoints("llama")), str(tmp_path / "out"), "--dry-run", "--json")
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    assert plan["quantized_tensors"] == 14
    assert set(plan["shards"]) == {"model.safetensors"}
    assert not (tmp_path / "out").exists()


def test_dry_run_text_names_each_tensor(checkpoints, tmp_path):
    proc = run_cli("convert", str(checkpoints("llama")), str(tmp_path / "out"), "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert "quantize model.layers.0.mlp.down_proj.weight" in " ".join(proc.stdout.split())
    assert "keep lm_head.weight" in " ".join(proc.stdout.split())


def test_missing_source(tmp_path):
    proc = run_cli("convert", str(tmp_path / "nope"), str(tmp_path / "out"))
    assert proc.returncode == 1
    assert "does not exist" in _one_line_error(proc)
    assert not (tmp_path / "out").exists()


def test_directory_without_weights(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "config.json").write_text("{}")
    proc = run_cli("convert", str(tmp_path / "src"), str(tmp_path / "out"))
    assert proc.returncode == 1
    assert "no model weights found" in _one_line_error(proc)


def test_non_empty_output_needs_overwrite_and_is_left_alone(checkpoints, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    proc = run_cli("convert", str(checkpoints("llama")), str(out), "--device", "cpu")
    assert proc.returncode == 2
    assert "--overwrite" in _one_line_error(proc)
    assert [p.name for p in out.iterdir()] == ["notes.txt"]


def test_overwrite_replaces_checkpoint_but_keeps_other_files(checkpoints, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / "model-00001-of-00009.safetensors").write_bytes(b"stale shard of an older conversion")
    proc = run_cli("convert", str(checkpoints("llama")), str(out), "--device", "cpu", "--overwrite")
    assert proc.returncode == 0, proc.stderr
    assert (out / "notes.txt").read_text() == "mine"
    assert not (out / "model-00001-of-00009.safetensors").exists()
    assert (out / "model.safetensors").exists() and (out / "config.json").exists()
    # --overwrite keeps a user's own files (as documented); `upload` then refuses the folder: said at this run.
    warning = [line for line in proc.stderr.splitlines() if "notes.txt" in line]
    assert len(warning) == 1 and "prequant upload` refuses" in warning[0] and "move them out" in warning[0]


def test_bad_option_value_is_a_usage_error(checkpoints, tmp_path):
    proc = run_cli("convert", str(checkpoints("llama")), str(tmp_path / "out"), "--quant-type", "int3")
    assert proc.returncode == 2
    assert "nf4 or fp4" in _one_line_error(proc)


def test_missing_argument_is_a_usage_error_without_traceback(tmp_path):
    proc = run_cli("convert", str(tmp_path))
    assert proc.returncode == 2
    assert "Missing argument" in proc.stderr and "output_dir" in proc.stderr.lower()
    assert "Traceback" not in proc.stderr


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_gpu_is_a_usage_error(checkpoints, tmp_path):
    proc = run_cli("convert", str(checkpoints("llama")), str(tmp_path / "out"), "--device", "cuda")
    assert proc.returncode == 2
    assert "no CUDA GPU" in _one_line_error(proc)
    assert not (tmp_path / "out").exists()


def test_help_shows_examples():
    proc = run_cli("convert", "--help")
    assert proc.returncode == 0
    assert "--max-shard-size" in proc.stdout and "Examples" in proc.stdout


def test_trace_gives_the_timeline_and_stage_times(checkpoints, tmp_path):
    """PREQUANT_TRACE (what scripts/bench/common.py reads): events in pipeline order, busy time for every stage that ran."""
    trace = tmp_path / "trace.json"
    run_cli("convert", str(checkpoints("llama")), str(tmp_path / "out"), "--device", "cpu",
            env={"PREQUANT_TRACE": str(trace)}, check=True)
    t = json.loads(trace.read_text())
    names = [name for name, _ in t["events"]]
    order = ["start", "imported", "quantizer-started", "planned", "pipeline-start", "pipeline-end",
             "manifest-written", "published", "exit"]
    assert [n for n in names if n in order] == order
    assert any(n.startswith("shard-written:") for n in names)
    times = [at for _, at in t["events"]]
    assert times == sorted(times)
    stages = {"quantize", "stats", "write", "sha256", "fsync", "loaded-get-wait", "quantized-put-wait"}
    assert stages <= t["busy"].keys()
    assert t["busy"]["quantize"] > 0 and t["busy"]["write"] > 0  # real work was timed
    assert all(0 <= s <= times[-1] - times[0] + 0.01 for s in t["busy"].values())  # no stage outlasts the process



def test_version_option():
    proc = run_cli("--version")
    assert proc.returncode == 0, proc.stderr
    from prequant import __version__

    assert proc.stdout.strip() == __version__ == run_cli("version").stdout.strip()


def test_unexpected_exception_is_one_line_with_the_debug_hint(checkpoints, tmp_path):
    """Any exception that is not a PrequantError (a bug, here injected mid-conversion) is one line, exit 1."""
    proc = run_cli("convert", str(checkpoints("llama")), str(tmp_path / "out"), "--device", "cpu",
                   env={"PREQUANT_FAILPOINT": "tensor-written:3:raise", "PREQUANT_DEBUG": ""})
    assert proc.returncode == 1
    line = _one_line_error(proc)
    assert line == ("Error: RuntimeError: failure injected at tensor-written (PREQUANT_FAILPOINT) "
                    "(PREQUANT_DEBUG=1 shows the traceback)")
    debug = run_cli("convert", str(checkpoints("llama")), str(tmp_path / "out2"), "--device", "cpu",
                    env={"PREQUANT_FAILPOINT": "tensor-written:3:raise", "PREQUANT_DEBUG": "1"})
    assert debug.returncode == 1 and "Traceback" in debug.stderr and "RuntimeError" in debug.stderr


def test_output_dir_name_too_long_is_one_line(checkpoints, tmp_path):
    proc = run_cli("convert", str(checkpoints("llama")), str(tmp_path / ("x" * 300)), "--device", "cpu")
    assert proc.returncode == 2
    assert "File name too long" in _one_line_error(proc)


@pytest.mark.parametrize("output_dir", ["", "   "], ids=["empty", "blank"])
def test_empty_output_dir_is_refused_and_the_current_directory_untouched(checkpoints, tmp_path, output_dir):
    """`prequant convert SRC "$OUT" --overwrite` with OUT unset must not write into the current directory."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    (cwd / "model.safetensors").write_bytes(b"the user's own weights")
    (cwd / "config.json").write_text("{}")
    for extra in ([], ["--overwrite"], ["--dry-run"]):
        proc = run_cli("convert", str(checkpoints("llama")), output_dir, "--device", "cpu", *extra, cwd=cwd)
        assert proc.returncode == 2, proc.stderr
        assert "OUTPUT_DIR is empty" in _one_line_error(proc)
    assert sorted(p.name for p in cwd.iterdir()) == ["config.json", "model.safetensors"]
    assert (cwd / "model.safetensors").read_bytes() == b"the user's own weights"


def test_json_help_says_what_each_command_prints():
    assert "(or the plan)" not in run_cli("verify", "--help").stdout
    assert "Print the report as JSON" in run_cli("verify", "--help").stdout
    assert "with --dry-run, the plan" in " ".join(run_cli("convert", "--help").stdout.split())


@pytest.mark.slow
@pytest.mark.parametrize("value", ["-1", "0", "nan", "inf"])
def test_max_rel_error_must_be_a_number_above_zero(converted_llama, value):
    src, out = converted_llama
    proc = run_cli("verify", str(out), "--source", str(src), "--max-rel-error", value)
    assert proc.returncode == 2 and "must be a number above 0" in _one_line_error(proc)


@pytest.mark.parametrize("device", ["gpu", "mps", "cuda:7"])
def test_dry_run_refuses_the_devices_a_run_refuses(checkpoints, tmp_path, device):
    import torch

    if device == "cuda:7" and torch.cuda.device_count() > 7:
        pytest.skip("this machine has a GPU 7")
    proc = run_cli("convert", str(checkpoints("llama")), str(tmp_path / "out"), "--dry-run", "--device", device)
    assert proc.returncode == 2 and "--device" in _one_line_error(proc)


def test_base_model_must_be_a_repo_id(checkpoints, tmp_path):
    proc = run_cli("convert", str(checkpoints("llama")), str(tmp_path / "out"), "--base-model", "not a repo")
    assert proc.returncode == 2 and "--base-model 'not a repo' is not a Hub repo id" in _one_line_error(proc)


def test_fused_moe_note_in_the_plan_and_summary_from_the_cli(checkpoints, tmp_path):
    """The fused-experts sentence reaches the plan and the summary the CLI prints."""
    note = "note: 77% of the parameters (196,608 of 254,784) stay unquantized: transformers 5 fuses"
    plan = run_cli("convert", str(checkpoints("mixtral")), str(tmp_path / "out"), "--dry-run")
    assert plan.returncode == 0 and note in plan.stdout, plan.stderr
    done = run_cli("convert", str(checkpoints("mixtral")), str(tmp_path / "out"), "--device", "cpu")
    assert done.returncode == 0 and note in done.stdout, done.stderr


# `prequant ARGS` in a subprocess, then what it held: its exit code, and whether torch and huggingface_hub were
# imported.
_PROBE = """
import json, sys
from prequant.cli import main
sys.argv = ["prequant", *sys.argv[1:]]
try:
    main()
except SystemExit as e:
    code = e.code
print(json.dumps({"code": code, "torch": "torch" in sys.modules, "hub": "huggingface_hub" in sys.modules}))
"""


def _probe(*args: str, cwd=None, env: dict | None = None) -> tuple[dict, subprocess.CompletedProcess]:
    """What `prequant ARGS` held when it stopped (see _PROBE), and the process (`env`: as for run_cli)."""
    proc = subprocess.run([sys.executable, "-c", _PROBE, *args], cwd=cwd, env=cli_env(env), capture_output=True,
                          text=True, timeout=120)
    assert proc.stdout.strip(), proc.stderr
    return json.loads(proc.stdout), proc


@pytest.mark.parametrize("spec", ["work/no-such-dir", "./x", "../x", "~/x", "/no/such/dir", "a/b/c", "org/name@"])
def test_a_path_that_does_not_exist_fails_before_torch_and_the_hub(tmp_path, spec):
    """A SOURCE spelled as a path (or `work/x` where ./work is a folder) is refused from its spelling and the disk: no
    Hub request (huggingface_hub never imported, so no retry either), and torch not imported (a fraction of a
    second instead of minutes of retries)."""
    cwd = tmp_path / "cwd"
    (cwd / "work" / "tiny").mkdir(parents=True)
    held, proc = _probe("convert", spec, "out", cwd=cwd, env={
        "HOME": str(tmp_path), "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9", "PREQUANT_HUB_RETRY_S": "5"})
    assert held == {"code": 1, "torch": False, "hub": False}, proc.stderr
    assert f"source {spec!r} does not exist" in _one_line_error(proc)


def test_a_typo_in_a_local_path_suggests_the_folder(tmp_path):
    cwd = tmp_path / "cwd"
    (cwd / "work" / "tiny").mkdir(parents=True)
    proc = run_cli("convert", "work/tiny-typo", "out", cwd=cwd)
    assert proc.returncode == 1
    line = _one_line_error(proc)
    assert "did you mean ./work/tiny?" in line and "work/ is a local folder" in line
    assert not (cwd / "out").exists()


def test_a_host_name_that_does_not_resolve_is_not_retried(tmp_path):
    """A DNS failure (no network, or a wrong HF_ENDPOINT) fails at the first try: no 'retrying' lines."""
    proc = run_cli("convert", "org/name", str(tmp_path / "out"),
                   env={"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://no-such-host.invalid",
                        "PREQUANT_HUB_RETRY_S": "5"})
    assert proc.returncode == 1
    line = _one_line_error(proc)
    assert "cannot reach the Hugging Face Hub at http://no-such-host.invalid" in line
    assert "tried" not in line


def test_a_setting_not_understood_is_warned_about_once(checkpoints, tmp_path):
    """`verify --source` reads PREQUANT_PROGRESS for each of its passes: still one warning."""
    src = str(checkpoints("llama"))
    assert run_cli("convert", src, str(tmp_path / "out"), "--device", "cpu").returncode == 0
    proc = run_cli("verify", str(tmp_path / "out"), "--source", src, env={"PREQUANT_PROGRESS": "fancy"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("PREQUANT_PROGRESS='fancy' is not understood") == 1, proc.stderr


def test_an_interrupted_conversion_says_to_run_the_same_command_again(checkpoints, tmp_path):
    """As README says: the same command continues (`--resume` only insists that there is something to continue)."""
    args = ("convert", str(checkpoints("llama")), str(tmp_path / "out"), "--device", "cpu")
    proc = run_cli(*args, env={"PREQUANT_FAILPOINT": "tensor-written:3:SIGINT"})
    assert proc.returncode == 130
    line = _one_line_error(proc)
    assert "run the same command again to continue" in line and "--resume" not in line
    assert run_cli(*args).returncode == 0


def test_quant_type_is_taken_in_any_case(checkpoints, tmp_path):
    proc = run_cli("convert", str(checkpoints("llama")), str(tmp_path / "out"), "--dry-run", "--json",
                   "--quant-type", "NF4")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["settings"]["quant_type"] == "nf4"


def test_private_without_push_to_hub_is_a_usage_error(checkpoints, tmp_path):
    proc = run_cli("convert", str(checkpoints("llama")), str(tmp_path / "out"), "--dry-run", "--private")
    assert proc.returncode == 2
    assert "--private applies to the repo that --push-to-hub creates" in _one_line_error(proc)


def test_overwrite_of_an_empty_folder_warns_about_nothing(checkpoints, tmp_path):
    proc = run_cli("convert", str(checkpoints("llama")), str(tmp_path / "clean"), "--device", "cpu", "--overwrite",
                   "--no-stats")
    assert proc.returncode == 0 and "warning" not in proc.stderr, proc.stderr


@pytest.mark.parametrize("job", ["convert", "merge"])
@pytest.mark.parametrize("option, value, says", [
    ("--quant-type", "int3", "--quant-type int3 is not supported; use nf4 or fp4"),
    ("--blocksize", "100", "--blocksize 100 is not supported"),
    ("--compute-dtype", "int8", "--compute-dtype int8 is not supported"),
    ("--quant-storage", "float64", "--quant-storage float64 is not supported"),
])
def test_a_bad_option_value_is_refused_before_torch_is_imported(checkpoints, tmp_path, job, option, value, says):
    src = str(checkpoints("llama"))
    args = [job, src, str(tmp_path / "out"), option, value] if job == "convert" else \
        [job, src, str(tmp_path / "out"), "--base", src, "--quantize", option, value]
    held, proc = _probe(*args)
    assert (held["code"], held["torch"]) == (2, False), proc.stderr
    assert says in _one_line_error(proc)


@pytest.mark.parametrize("spec", ["work/no-such-lora", "./x", "~/x", "/no/such/lora", "a/b/c"])
def test_a_mistyped_adapter_path_fails_before_torch_and_the_hub(checkpoints, tmp_path, spec):
    cwd = tmp_path / "cwd"
    (cwd / "work" / "lora").mkdir(parents=True)
    held, proc = _probe("merge", spec, "out", "--base", str(checkpoints("llama")), cwd=cwd, env={
        "HOME": str(tmp_path), "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9", "PREQUANT_HUB_RETRY_S": "5"})
    assert (held["code"], held["torch"]) == (1, False), proc.stderr
    line = _one_line_error(proc)
    assert line.startswith(f"Error: ADAPTER {spec!r} does not exist"), line
    assert ("work/ is a local folder" if spec.startswith("work/") else "no such folder") in line


def test_a_mistyped_base_path_fails_before_torch_and_the_hub(tmp_path):
    cwd = tmp_path / "cwd"
    (cwd / "work" / "tiny").mkdir(parents=True)
    (cwd / "lora").mkdir()
    held, proc = _probe("merge", "lora", "out", "--base", "work/tiny-typo", cwd=cwd, env={
        "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9", "PREQUANT_HUB_RETRY_S": "5"})
    assert (held["code"], held["torch"]) == (1, False), proc.stderr
    assert "source 'work/tiny-typo' does not exist (did you mean ./work/tiny?)" in _one_line_error(proc)
