"""Benchmark: how a checkpoint's read-ahead slows a cold process' start-up (its imports), and whether
de-prioritizing the read-ahead helps.

Each mode drops the page cache (root needed, else it says so), then times `import torch, transformers` and
the LlamaForCausalLM class (what `prequant convert` imports before it can plan) in a fresh interpreter,
while a background thread of that interpreter reads a scratch file of --size-gb ahead:

  none     no read-ahead: the baseline
  normal   prequant.readahead.willneed over the whole file (what the CLI starts before its imports)
  idle     the same from a thread with I/O priority class idle (ioprio_set)
  paced    one device-sized request at a time, each waited for before the next

Prints each mode's import time and its ratio to the baseline, and when the read-ahead finished.

    python scripts/bench_startup.py --size-gb 8 --dir /tmp
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHILD = r"""
import ctypes, json, os, sys, threading, time
sys.path.insert(0, sys.argv[3])
mode, path = sys.argv[1], sys.argv[2]
t0 = time.monotonic()
done = {}

def read_ahead():
    from prequant import readahead
    if mode == "idle":
        ctypes.CDLL(None, use_errno=True).syscall(251, 1, threading.get_native_id(), 3 << 13)  # ioprio_set, x86_64
    fd = os.open(path, os.O_RDONLY)
    size = os.fstat(fd).st_size
    if mode == "paced":
        chunk = readahead.advice_chunk(fd)
        for off in range(0, size, chunk):
            readahead.willneed(fd, off, min(chunk, size - off), chunk)
            os.pread(fd, 1, min(off + chunk, size) - 1)  # wait until this request is in
    else:
        readahead.willneed(fd, 0, size)
        os.pread(fd, 1, size - 1)
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


def drop_caches() -> bool:
    try:
        subprocess.run(["sync"], check=True)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gb", type=float, default=8)
    ap.add_argument("--dir", type=Path, default=Path("/tmp"))
    ap.add_argument("--modes", default="none,normal,idle,paced")
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
            cold = drop_caches()
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
