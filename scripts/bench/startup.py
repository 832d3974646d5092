"""Benchmark: a tiny checkpoint's whole `prequant convert` process (and `--dry-run`), libraries warm, against a
baseline measured in the same run, the runs interleaved so that a shared machine's load hits both alike.

    python scripts/bench/startup.py [--repeats 5] [--device cpu] [--before DIR]

Modes, each a fresh `python -m prequant convert` of `scripts/make_tiny_checkpoint.py`'s checkpoint:
  predicted   this tree: the layout predicted from names, settled where the rules are verified for the
              installed transformers (no modeling code imported), else checked against transformers' before
              publishing
  head start  this tree with PREQUANT_CONFIRM_LAYOUT=1: the pipeline starts on the prediction, transformers'
              layout confirmed before publishing (what "predicted" was before settled predictions)
  baseline    this tree with PREQUANT_PREDICT_LAYOUT=0 (the conversion waits for transformers' layout), or, with
              --before DIR, the prequant in DIR (e.g. `git worktree add /tmp/before 288ae15`)
  dry-run     `--dry-run` of baseline and predicted
Prints best-of-N wall and CPU seconds (user + system, children included: the layout child's too) per mode and
the ratio to the baseline, and, from PREQUANT_TRACE, when the pipeline started in the best predicted run.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from common import ROOT, read_trace, run_env, timed  # this directory


def _run(tree: Path, args: list[str], env: dict, trace: Path) -> tuple[float, float, dict]:
    """One whole `prequant convert` of `tree`'s prequant: wall and CPU seconds (memory not sampled: the sampler's
    own CPU would blur a 2-second figure), and its trace's events as seconds since its first."""
    trace.unlink(missing_ok=True)  # a tree that writes none must not show the last run's
    r = timed([sys.executable, "-m", "prequant", "convert", *args], env=run_env(tree, **env, PREQUANT_TRACE=str(trace)),
              memory=False, cwd=tree)
    return r["seconds"], r["cpu_seconds"], read_trace(trace).get("events", {})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--before", type=Path, help="a checkout of the prequant to compare with (default: this tree "
                    "with PREQUANT_PREDICT_LAYOUT=0)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--skip", action="append", default=[], metavar="MODE",
                    help="leave a mode out (repeatable), e.g. --skip 'head start' where time is short")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="prequant-tiny-startup-"))
    try:
        tiny = work / "tiny"
        subprocess.run([sys.executable, str(ROOT / "scripts" / "make_tiny_checkpoint.py"), str(tiny)], check=True,
                       capture_output=True)
        before = (args.before or ROOT).resolve()
        base_env = {} if args.before else {"PREQUANT_PREDICT_LAYOUT": "0"}
        modes = {
            "baseline": (before, base_env, []),
            "predicted": (ROOT, {}, []),
            "head start": (ROOT, {"PREQUANT_CONFIRM_LAYOUT": "1"}, []),
            "dry-run baseline": (before, base_env, ["--dry-run"]),
            "dry-run": (ROOT, {}, ["--dry-run"]),
        }
        for mode in args.skip:
            if mode not in modes or mode in ("baseline", "predicted", "dry-run baseline", "dry-run"):
                ap.error(f"--skip {mode!r}: only 'head start' can be left out (the others make the figures)")
            del modes[mode]
        # One untimed run of each tree first: bytecode compiled, libraries in the page cache ("libraries warm").
        for tree, env, extra in modes.values():
            _run(tree, [str(tiny), str(work / "warm"), "--device", args.device, "--overwrite", *extra], env,
                 work / "t.json")
        results: dict[str, list[tuple[float, float, dict]]] = {m: [] for m in modes}
        for i in range(args.repeats):
            for mode, (tree, env, extra) in modes.items():
                out = work / f"out-{i}-{mode.replace(' ', '-')}"
                results[mode].append(_run(tree, [str(tiny), str(out), "--device", args.device, *extra], env,
                                          work / "t.json"))
                # as it goes, so that a run cut short by its time limit still shows what it measured
                print(f"  round {i + 1}, {mode}: {results[mode][-1][0]:.2f} s", file=sys.stderr, flush=True)
                shutil.rmtree(out, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report = {}
    for mode, runs in results.items():
        wall, cpu, events = min(runs, key=lambda r: r[0])
        report[mode] = {"best_wall_s": round(wall, 2), "best_cpu_s": round(min(r[1] for r in runs), 2),
                        "walls": [round(r[0], 2) for r in runs], "events": events}
    for mode, r in report.items():
        base = report["dry-run baseline" if mode.startswith("dry-run") else "baseline"]
        print(f"{mode:17} best wall {r['best_wall_s']:5.2f} s ({r['best_wall_s'] / base['best_wall_s']:.2f}x the "
              f"baseline), best CPU {r['best_cpu_s']:5.2f} s; all: {r['walls']}")
    ev = report["predicted"]["events"]
    print("predicted, best run: " + ", ".join(f"{k} {v}" for k, v in ev.items()))
    if args.json:  # the two keys summary.py reads, beside every mode's figures
        summary = {"convert_seconds": report["predicted"]["best_wall_s"],
                   "dry_run_seconds": report["dry-run"]["best_wall_s"]}
        args.json.write_text(json.dumps(summary | {"modes": report}, indent=1))


if __name__ == "__main__":
    main()
