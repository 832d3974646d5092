"""What a cold CUDA start reads, and whether reading it ahead pays (issue 17's cold Grok run).

Root only (it drops the page cache): on the GPU machine,

    python3 scripts/probe_cold_cuda.py --json OUT.json

A child process does what a CUDA conversion's start does (import torch, start CUDA, import bitsandbytes, quantize
one tensor) and reports its timeline, the files it has mapped and the modules it imported. Variants, each from a
dropped cache:
  cold        the start alone; then the page cache says what it read (mincore on every file it used)
  warm        the start again, nothing dropped
  warm-lean   the start with bitsandbytes imported lean (`prequant.bnb.importing`), beside warm-plain
  cold-lean   the lean start from a dropped cache (--lean-only stops here)
  seq-libs    the mapped files read whole, one after another, then the start
  par-all     the mapped files and module files read whole on 16 threads, then the start
  touched     only the pages the cold start had in the cache (an oracle), on 16 threads, then the start
  beside      the mapped files read whole on 16 threads beside the start (what a CLI could do at once)
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
from prequant.util.pagecache import resident_pages  # standard library only

CHILD = r"""
import json, os, sys, time, importlib.util
t0 = float(sys.argv[1]); marks = {}
import torch; marks["torch"] = time.time() - t0
torch.zeros(1, device="cuda"); torch.cuda.synchronize(); marks["cuda"] = time.time() - t0
from prequant.bnb import importing
if sys.argv[2] == "lean":
    importing.lean()
F = importing.functional(); marks["bnb"] = time.time() - t0
x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
F.quantize_4bit(x, quant_type="nf4", compress_statistics=True); torch.cuda.synchronize(); marks["quantized"] = time.time() - t0
maps = sorted({line.split(None, 5)[5].strip() for line in open("/proc/self/maps") if len(line.split(None, 5)) == 6
               and line.split(None, 5)[5].startswith("/")})
mods = set()
for m in list(sys.modules.values()):
    f = getattr(m, "__file__", None)
    if f and os.path.exists(f):
        mods.add(f)
        if f.endswith(".py"):
            c = importlib.util.cache_from_source(f)
            if os.path.exists(c):
                mods.add(c)
json.dump({"marks": marks, "maps": [p for p in maps if os.path.isfile(p)], "modules": sorted(mods)}, sys.stdout)
"""


def drop() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def start(how: str = "plain") -> tuple[float, dict]:
    t0 = time.time()
    out = subprocess.run([sys.executable, "-c", CHILD, str(t0), how], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH"))
                                                                           if p)}).stdout  # fmt: skip
    return time.time() - t0, json.loads(out)


def read_whole(path: str) -> int:
    n = 0
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(8 << 20):
            n += len(chunk)
    return n


def resident_ranges(path: str) -> list[tuple[int, int]]:
    """(offset, length) runs of the file's pages now in the page cache."""
    pages = resident_pages(path) or b""
    runs, begin = [], None
    for i, v in enumerate(pages):
        if v & 1 and begin is None:
            begin = i
        elif not v & 1 and begin is not None:
            runs.append((begin * mmap.PAGESIZE, (i - begin) * mmap.PAGESIZE))
            begin = None
    if begin is not None:
        runs.append((begin * mmap.PAGESIZE, os.path.getsize(path) - begin * mmap.PAGESIZE))
    return runs


def read_ranges(path: str, runs: list[tuple[int, int]]) -> int:
    fd = os.open(path, os.O_RDONLY)
    try:
        n = 0
        for off, length in runs:
            n += len(os.pread(fd, length, off))
        return n
    finally:
        os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--lean-only", action="store_true", help="stop after the cold, warm and lean starts")
    args = ap.parse_args()
    result: dict = {}
    start()  # bytecode cached, as an installed package has it
    drop()
    t, info = start()
    maps, modules = info["maps"], info["modules"]
    sizes = {p: os.path.getsize(p) for p in maps + modules}
    touched = {p: resident_ranges(p) for p in maps + modules}
    result["cold"] = {"seconds": round(t, 2), "marks": info["marks"]}
    result["files"] = {
        "mapped": len(maps), "mapped_bytes": sum(sizes[p] for p in maps),
        "modules": len(modules), "module_bytes": sum(sizes[p] for p in modules),
        "touched_bytes": sum(n for p in touched for _, n in touched[p]),
        "biggest_mapped": sorted(((sizes[p], sum(n for _, n in touched[p]), p) for p in maps), reverse=True)[:25],
    }
    print(json.dumps(result, indent=1), flush=True)
    t, info = start()
    result["warm"] = {"seconds": round(t, 2), "marks": info["marks"]}
    print("warm", result["warm"], flush=True)
    for how in ("lean", "plain", "lean"):  # bitsandbytes imported lean (bnb.importing), beside the plain import
        t, info = start(how)
        result[f"warm-{how}"] = {"seconds": round(t, 2), "marks": info["marks"]}
        print(f"warm-{how}", result[f"warm-{how}"], flush=True)
    drop()
    t, info = start("lean")
    result["cold-lean"] = {"seconds": round(t, 2), "marks": info["marks"]}
    print("cold-lean", result["cold-lean"], flush=True)
    if args.lean_only:
        _save(args, result)
        return

    def timed(name: str, prefetch, beside: bool = False) -> None:
        drop()
        t0 = time.time()
        if beside:
            th = threading.Thread(target=prefetch)
            th.start()
            t, info = start()
            th.join()
            total = time.time() - t0
        else:
            prefetch()
            t_read = time.time() - t0
            t, info = start()
            total = time.time() - t0
        result[name] = {"seconds": round(total, 2), "start": round(t, 2), "marks": info["marks"]}
        if not beside:
            result[name]["prefetch"] = round(t_read, 2)
        print(name, result[name], flush=True)

    timed("seq-libs", lambda: [read_whole(p) for p in maps])
    with ThreadPoolExecutor(16) as pool:
        timed("par-all", lambda: list(pool.map(read_whole, maps + modules)))
        timed("touched", lambda: list(pool.map(lambda p: read_ranges(p, touched[p]), maps + modules)))
        timed("beside", lambda: list(pool.map(read_whole, maps)), beside=True)
    _save(args, result)


def _save(args, result: dict) -> None:
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
