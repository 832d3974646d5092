"""A conversion started on the predicted layout publishes transformers' layout: checked before publishing, and
started again on transformers' layout when the prediction was wrong."""

import json
import shutil

from prequant.bnb.predict import ENV

from conftest import run_cli

TRANSFORMERS_ONLY = {ENV: "0"}  # the conversion waits for transformers' layout, as before prediction existed


def _convert(src, out, tmp_path, env):
    trace = tmp_path / f"{out.name}.trace.json"
    proc = run_cli("convert", str(src), str(out), "--device", "cpu", "--json",
                   env={**env, "PREQUANT_TRACE": str(trace), "PREQUANT_DEBUG": ""})
    assert proc.returncode == 0, proc.stderr
    events = [name for name, _ in json.loads(trace.read_text())["events"]]
    return json.loads(proc.stdout), events


def _files(out):
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.is_file()}


def _record(out):
    record = json.loads((out / "prequant.json").read_text())
    for key in ("created", "seconds", "timings", "hostname"):
        record.pop(key, None)
    return record


def test_a_right_prediction_is_confirmed_before_publishing_and_changes_nothing(checkpoints, tmp_path):
    src = checkpoints("llama", "100KB")
    summary, events = _convert(src, tmp_path / "predicted", tmp_path, {})
    reference, ref_events = _convert(src, tmp_path / "decided", tmp_path, TRANSFORMERS_ONLY)
    assert "layout-predicted" in events and "layout-predicted" not in ref_events
    assert events.index("layout-confirmed") < events.index("manifest-written") < events.index("published")
    assert _files(tmp_path / "predicted") == _files(tmp_path / "decided")
    assert summary.pop("seconds") and reference.pop("seconds")
    assert {k: v for k, v in summary.items() if k != "output_dir"} == \
        {k: v for k, v in reference.items() if k != "output_dir"}


def test_a_wrong_prediction_is_caught_before_publishing_and_transformers_layout_is_written(checkpoints, tmp_path):
    """config.json says 1 layer where the files hold 2: transformers' model has no layer 1, so it keeps layer 1's
    projections unquantized (not linear weights of its model), while the names alone say nn.Linear."""
    src = shutil.copytree(checkpoints("llama"), tmp_path / "src")
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1}))
    summary, events = _convert(src, tmp_path / "predicted", tmp_path, {})
    _, ref_events = _convert(src, tmp_path / "decided", tmp_path, TRANSFORMERS_ONLY)
    assert "layout-mismatch" in events and "layout-mismatch" not in ref_events
    assert events.index("layout-mismatch") < events.index("published")
    assert events.count("pipeline-start") == 2, "not started again on transformers' layout"
    assert _files(tmp_path / "predicted") == _files(tmp_path / "decided")
    assert _record(tmp_path / "predicted") == _record(tmp_path / "decided")
    assert summary["tensors_quantized"] == 7, "only layer 0's seven projections are quantized, as transformers does"
