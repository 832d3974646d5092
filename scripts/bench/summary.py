"""Every figure issue 17 asks for, from the JSON files one scripts/gpu/gpu_checks.sh run leaves in a folder, in one
table.

    python scripts/bench/summary.py OUT_DIR            # prints the table, writes OUT_DIR/summary.json

Reads cpu_kernel.json (cpu_kernel.py --json), bench-llama16.json (convert.py --also-device cpu --warm-libraries),
bench-grok33.json (convert.py --memory-limit-gib --hub) and startup.json (startup.py); a missing file or field (a
step that failed or ran out of time) shows as "missing", so the table always prints.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

GIB = 2**30


def _load(folder: Path, name: str) -> dict:
    try:
        return json.loads((folder / name).read_text())
    except (OSError, ValueError):
        return {}


def _get(d: dict, *keys):
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def rows(folder: Path) -> list[tuple[str, object, str, str]]:
    """(what, measured, target, verdict) for each figure."""
    out: list[tuple[str, object, str, str]] = []

    def add(what: str, value, target: str, ok: bool | None) -> None:
        verdict = "missing" if value is None else ("-" if ok is None else ("met" if ok else "NOT met"))
        out.append((what, value, target, verdict))

    kernel = _load(folder, "cpu_kernel.json")
    by_threads = {r["threads"]: r for r in kernel.get("results", [])}
    for t in (1, 2, 4, 8, 16):
        r = by_threads.get(t, {})
        gbps = _get(r, "prequant", "best_gbps")
        target = {1: ">= 0.35 GB/s", 16: ">= 1.5 GB/s"}.get(t, "")
        add(f"CPU kernel, {t} thread(s), GB/s (x bitsandbytes: {_fmt(r.get('speedup_best'))}; "
            f"efficiency {_fmt(_get(r, 'prequant', 'efficiency'))}; stats {_fmt(_get(r, 'prequant', 'stats_best_gbps'))} GB/s)",
            gbps, target, None if not target or gbps is None else gbps >= float(target.split()[1]))
    llama = _load(folder, "bench-llama16.json")
    v = _get(llama, "prequant_also", "ratio_to_floor")
    add("16 GB Llama, --device cpu, x floor", v, "<= 1.3", None if v is None else v <= 1.3)
    add("16 GB Llama, --device cpu, same bytes as cuda", _get(llama, "prequant_also", "same_bytes"), "True",
        _get(llama, "prequant_also", "same_bytes"))
    v = _get(llama, "prequant", "ratio_to_floor")
    add("16 GB Llama, cuda, libraries warm, x floor", v, "<= 1.4", None if v is None else v <= 1.4)
    add("16 GB Llama, cuda: GPU GiB, NVML per process / torch peak reserved",
        _pair(_get(llama, "prequant", "peak_gpu_process_bytes"), _get(llama, "prequant", "peak_gpu_bytes")), "", None)
    grok = _load(folder, "bench-grok33.json")
    v = _get(grok, "prequant", "ratio_to_floor")
    add(f"Grok shapes {_fmt(_get(grok, 'source_bytes'), 1e9)} GB, all cold, x floor", v, "<= 1.1",
        None if v is None else v <= 1.1)
    add("Grok: GPU GiB, NVML per process / torch peak reserved",
        _pair(_get(grok, "prequant", "peak_gpu_process_bytes"), _get(grok, "prequant", "peak_gpu_bytes")), "", None)
    lim = _get(grok, "prequant_limited") or {}
    add(f"Grok, torch capped at {_fmt(lim.get('memory_limit_bytes'), GIB)} GiB: same bytes", lim.get("same_bytes"),
        "True", lim.get("same_bytes"))
    add("Grok capped: GPU GiB, NVML per process / torch peak reserved",
        _pair(lim.get("peak_gpu_process_bytes"), lim.get("peak_gpu_bytes")), "", None)
    hub = _get(grok, "hub") or {}
    v = hub.get("ratio_to_max_download_local")
    add(f"Grok from the local Hub, --delete-source-shards, x max(download {_fmt(hub.get('download_seconds'))} s, "
        f"local {_fmt(_get(grok, 'prequant', 'seconds'))} s)", v, "<= 1.2", None if v is None else v <= 1.2)
    c = hub.get("convert") or {}
    add("Grok Hub path: peak extra disk GB (bound: 2 shards + output)", _fmt(c.get("peak_disk_extra_bytes"), 1e9),
        f"<= {_fmt(c.get('disk_bound_bytes'), 1e9)}", c.get("within_disk_bound"))
    add("Grok Hub path: same bytes as the local conversion", c.get("same_bytes"), "True", c.get("same_bytes"))
    add("local Hub server alone, GB/s (warm page cache)", hub.get("server_gbps"), "", None)
    startup = _load(folder, "startup.json")
    for key, label in (("convert_seconds", "tiny checkpoint, whole process, libraries warm, s"),
                       ("dry_run_seconds", "tiny checkpoint --dry-run, libraries warm, s")):
        v = startup.get(key)
        add(label, v, "<= 3.5", None if v is None else v <= 3.5)
    return out


def _fmt(v, scale: float = 1.0) -> str:
    return "?" if v is None else f"{v / scale:.3g}"


def _pair(a, b) -> str | None:
    return None if a is None and b is None else f"{_fmt(a, GIB)} / {_fmt(b, GIB)}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", type=Path, help="where one scripts/gpu/gpu_checks.sh run left its JSON files")
    folder = ap.parse_args().folder
    table = rows(folder)
    width = max(len(r[0]) for r in table)
    print(f"\n{'figure (issue 17)':{width}}  {'measured':>14}  {'target':>14}  verdict")
    for what, value, target, verdict in table:
        shown = f"{value:.3f}" if isinstance(value, float) else str(value)
        print(f"{what:{width}}  {shown:>14}  {target:>14}  {verdict}")
    (folder / "summary.json").write_text(json.dumps(
        [{"figure": w, "measured": v, "target": t, "verdict": d} for w, v, t, d in table], indent=1))


if __name__ == "__main__":
    main()
