"""Benchmark: how a checkpoint's read-ahead slows a cold process' start-up (its imports), by read-ahead depth.

Each mode drops the page cache (root needed, else it says so), then times `import torch, transformers` and
the LlamaForCausalLM class (what `prequant convert` imports before it can plan) in a fresh interpreter,
while a background thread of that interpreter reads a scratch file of --size-gb ahead with
prequant.readahead.Readahead:

  none        no read-ahead: the baseline
  unbounded   advice for the whole file at once, as the read-ahead did before it had a depth
  32M, 128M   at most that many bytes asked of the disk and not yet read (readahead.START_DEPTH and
              PIPELINE_DEPTH are the depths the CLI uses while starting up and once the pipeline runs)

Prints each mode's import time, its ratio to the baseline, and when the read-ahead finished. With
--warm-libraries the libraries are imported once after the cache is dropped, so only the file is cold.

    python scripts/bench_startup.py --size-gb 8 --dir /tmp
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from bench import drop_caches  # this directory: the same cold (or warm-library) start as the bench

ROOT = Path(__file__).resolve().parent.parent

CHILD = r"""
import json, os, sys, threading, time
sys.path.insert(0, sys.argv[3])
mode, path = sys.argv[1], sys.argv[2]
t0 = time.monotonic()
done = {}

def read_ahead():
    from pathlib import Path
    from prequant.conversion import readahead
    depth = {"unbounded": 1 << 60, "32M": 32 << 20, "128M": 128 << 20}[mode]
    # The whole file as its window: nothing consumes it here, and a window smaller than the file would wait forever.
    readahead.Readahead([Path(path)], window=os.path.getsize(path), depth=depth)._thread.join()
    done["readahead_s"] = round(time.monotonic() - t0, 2)

if mode != "none":
    thread = threading.Thread(target=read_ahead, daemon=True)
    thread.start()
import torch, transformers
from transformers import LlamaForCausalLM
imports = round(time.monotonic() - t0, 2)
if mode != "none":
    thread.join()
print(json.dumps({"mode": mode, "imports_s": imports, **done}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gb", type=float, default=8)
    ap.add_argument("--dir", type=Path, default=Path("/tmp"))
    ap.add_argument("--modes", default="none,unbounded,32M,128M")
    ap.add_argument("--warm-libraries", action="store_true", help="only the scratch file is cold")
    args = ap.parse_args()
    scratch = args.dir / "prequant-startup-scratch.bin"
    size = int(args.size_gb * 1e9)
    if not scratch.exists() or scratch.stat().st_size != size:
        with open(scratch, "wb") as f:  # written, not sparse: the disk must really read it back
            block = os.urandom(64 << 20)
            for start in range(0, size, len(block)):
                f.write(block[: min(len(block), size - start)])
    results = []
    try:
        for mode in args.modes.split(","):
            cold = drop_caches(args.warm_libraries)
            out = subprocess.run([sys.executable, "-c", CHILD, mode, str(scratch), str(ROOT)], check=True,
                                 capture_output=True, text=True).stdout
            results.append(json.loads(out.strip().splitlines()[-1]) | {"cold": cold})
    finally:
        scratch.unlink(missing_ok=True)
    base = next((r["imports_s"] for r in results if r["mode"] == "none"), None)
    for r in results:
        ratio = f"{r['imports_s'] / base:.2f}x" if base else "-"
        ahead = f", read-ahead of {args.size_gb:g} GB done at {r['readahead_s']} s" if "readahead_s" in r else ""
        cache = "" if r["cold"] else " (WARM: could not drop caches)"
        print(f"{r['mode']:7} imports {r['imports_s']:5.1f} s ({ratio} the baseline){ahead}{cache}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
