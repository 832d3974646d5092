"""Benchmark: how far the read-ahead may lead the pipeline's writes (PREQUANT_READAHEAD_WINDOW), one run.

The same synthetic checkpoint as convert.py, its cold read and its floor (the read while dd durably writes as
many bytes as the output), then `prequant convert` as a whole process for every device and window, interleaved,
each from a cold page cache (libraries warm with --warm-libraries): wall time, its ratio to the floor, when the
read-ahead had read the whole source, when the quantizer was ready (CUDA's, where it started on a thread) and when
the pipeline ended (PREQUANT_TRACE), the process tree's peak RssAnon, and whether every run wrote the same bytes.

    python scripts/bench/window.py --size-gb 16 --shape llama --devices cuda,cpu --windows 2,4,0 --warm-libraries
    python scripts/bench/window.py --size-gb 33 --shape grok --devices cuda --windows 2,0 --repeats 2

--env NAME=V1,V2 also runs each of those values of one environment variable (e.g. the read-ahead's depth beside
cold libraries, PREQUANT_READAHEAD_COLD_DEPTH, or PREQUANT_CPU_WORKERS); every run records the disk's timeline
(/proc/diskstats: GB/s read and written and how busy it was, per second), where the disk can be found.

    python scripts/bench/window.py --size-gb 33 --shape grok --devices cuda --windows 0 \
        --env PREQUANT_READAHEAD_COLD_DEPTH=1048576,8388608 --repeats 2

--repeats N runs every device, window and value N times, in turn, so that one run's luck with the disk (the same code
took 28.6-32.1 s for the cold Grok shapes on one lease) does not decide between them.

A window is GB of source read ahead of what the pipeline has written; 0 is the start-up's window (a quarter of the
memory: the read-ahead reads the whole source as fast as it can).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from common import DiskSampler, cold_read, drop_caches, emit, read_write_floor, run_prequant  # this directory
from synthetic import generated, source_arguments

WINDOW_ENV = "PREQUANT_READAHEAD_WINDOW"  # prequant/conversion/readahead.py; spelled here to run without torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source_arguments(ap)
    ap.add_argument("--devices", default="cuda", help="comma-separated, e.g. cuda,cpu")
    ap.add_argument("--windows", default="2,0", help="comma-separated GB; 0: the start-up's window")
    ap.add_argument("--warm-libraries", action="store_true", help="cold checkpoint, warm Python libraries")
    ap.add_argument("--env", metavar="NAME=V1,V2", help="also sweep these values of one environment variable")
    ap.add_argument("--repeats", type=int, default=1, help="run every device and window this many times, in turn")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    src = generated(args.shape, args.size_gb, args.dir, args.layers, args.dims)
    shards = sorted(src.glob("*.safetensors"))
    report: dict = {"shape": args.shape, "source_bytes": sum(p.stat().st_size for p in shards),
                    "libraries": "warm" if args.warm_libraries else "cold", "runs": []}  # fmt: skip
    report["cold_cache"] = drop_caches()
    report["read"] = cold_read(shards)
    report["read"].pop("stdout")
    hashes = None
    name, _, values = (args.env or "").partition("=")
    if name and not values:
        ap.error(f"--env {args.env}: give NAME=V1,V2 (the values to run)")
    configs = [(d, w, v) for d in args.devices.split(",") for w in args.windows.split(",")
               for v in (values.split(",") if name else [None])]  # fmt: skip
    for device, window, value in configs * args.repeats:  # repeats interleaved: a lease's drift spreads over all
        drop_caches(args.warm_libraries)
        out = args.dir / "out-window"
        env = {WINDOW_ENV: str(int(float(window) * 1e9)), **({name: value} if name else {})}
        disk = DiskSampler(src)
        run = run_prequant(str(src), out, device, args.dir, extra_env=env)
        disk_timeline = disk.stop()
        shutil.rmtree(out, ignore_errors=True)
        events = run.get("trace", {}).get("events", {})
        row = {"device": device, "window_gb": float(window), "seconds": run["seconds"],
               "read_ahead_done": events.get("read-ahead-done"), "pipeline_start": events.get("pipeline-start"),
               "pipeline_end": events.get("pipeline-end"), "output_bytes": run["output_bytes"],
               "quantizer_ready": events.get("cuda-ready", events.get("quantizer-ready", events.get("quantizer-started"))),
               "peak_rss_anon": run["peak_rss_anon"],
               "busy": run.get("trace", {}).get("busy", {}), "env": {name: value} if name else {},
               "events": events, "disk": disk_timeline}  # fmt: skip
        hashes = report["weight_sha256"] = hashes or run["weight_sha256"]  # the first run's: every other's must match
        row["same_bytes"] = run["weight_sha256"] == hashes
        report["runs"].append(row)
        print(f"{device} window {window} GB{f' {name}={value}' if name else ''}: {row['seconds']} s", file=sys.stderr)
        if "read_write" not in report:  # the floor needs the output's size: right after the first run, so
            # that a run cut short by a time limit still has it
            disk = DiskSampler(src)
            report["read_write"] = read_write_floor(shards, row["output_bytes"], args.dir)
            report["read_write"]["disk"] = disk.stop()
            report["read_write"].pop("stdout")
            print(f"floor {report['read_write']['seconds']} s (read {report['read']['seconds']} s)", file=sys.stderr)
        if args.json:  # after every run: what a time limit cuts short is still on disk
            args.json.write_text(json.dumps(report, indent=1))
    floor = report["read_write"]["seconds"]
    print(f"\nsource {report['source_bytes'] / 1e9:.1f} GB {args.shape}, {report['libraries']} libraries: read "
          f"{report['read']['seconds']} s, floor {floor} s", file=sys.stderr)
    print(f"{'device':6} {'window GB':>9} {'value':>10} {'wall s':>7} {'x floor':>8} {'quantizer':>9} "
          f"{'read-ahead done':>16} {'pipeline':>14} {'disk busy':>9} {'RssAnon GiB':>11} {'same bytes':>10}",
          file=sys.stderr)
    for row in report["runs"]:
        row["ratio_to_floor"] = round(row["seconds"] / floor, 3)
        span = f"{row['pipeline_start']}-{row['pipeline_end']}"
        busy = [s["busy"] for s in row["disk"]]
        row["disk_busy"] = round(sum(busy) / len(busy), 2) if busy else None  # the run's mean
        value = next(iter(row["env"].values()), "-")
        rss = round(row["peak_rss_anon"] / 2**30, 2) if row["peak_rss_anon"] else None
        print(f"{row['device']:6} {row['window_gb']:9g} {value:>10} {row['seconds']:7.1f} {row['ratio_to_floor']:8.3f} "
              f"{row['quantizer_ready']!s:>9} {row['read_ahead_done']!s:>16} {span:>14} {row['disk_busy']!s:>9} "
              f"{rss!s:>11} {row['same_bytes']!s:>10}", file=sys.stderr)
    emit(report, args.json)


if __name__ == "__main__":
    main()
