"""scripts/bench.py runs end to end on a tiny synthetic checkpoint and reports what the README's tables use.

No timing is asserted (timings belong to the benchmark itself); this keeps the script working."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_bench_reports_read_floor_and_prequant_with_ratios_memory_and_timeline(tmp_path):
    report_file = tmp_path / "bench.json"
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench.py"), "--size-gb", "0.05", "--shape", "uniform",
         "--device", "cpu", "--dir", str(tmp_path / "work"), "--json", str(report_file)],
        check=True, capture_output=True, text=True, timeout=600,
    )
    report = json.loads(report_file.read_text())
    assert report["source_bytes"] > 0.04e9 and report["device"] == "cpu"
    for key in ("read", "read_write", "prequant"):
        m = report[key]
        assert m["seconds"] > 0
        assert m["ratio_to_read"] == round(m["seconds"] / report["read"]["seconds"], 3)
        assert m["ratio_to_floor"] == round(m["seconds"] / report["read_write"]["seconds"], 3)
    p = report["prequant"]
    assert 0 < p["peak_rss_anon"] <= p["peak_vm_rss"]
    assert 0 < p["output_bytes"] < report["source_bytes"]  # NF4: about a third of bf16
    events = p["trace"]["events"]
    assert list(events)[:1] == ["start"] and events["planned"] <= events["pipeline-end"] <= events["exit"]
    assert not (tmp_path / "work" / "out-prequant").exists()  # outputs removed unless --keep
