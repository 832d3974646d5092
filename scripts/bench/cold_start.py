"""Benchmark: what a cold start of `prequant convert --device cuda` reads from the disk, and what it costs.

    python scripts/bench/cold_start.py [--device cuda] [--repeats 2] [--json FILE]

A tiny checkpoint's whole conversion (`scripts/make_tiny_checkpoint.py`), so that the start-up is all there is:
  cold      the page cache dropped first: torch, CUDA and bitsandbytes read from the disk page fault by page fault
  warm      the same with nothing dropped
  touched   the page cache dropped, then exactly the pages the cold run left in it read first, on 8 threads in
            8 MiB reads (timed apart), then the conversion: what reading the libraries ahead could buy at best
Between the cold run and the next, every file under the interpreter's paths, the pycache prefix and the system's
library folders with pages in the page cache is listed: resident bytes by group (torch/lib, each nvidia package,
bitsandbytes, Python files, system libraries), and for ELF files the bytes the loader maps (SHF_ALLOC) and the
device code (.nv_fatbin) apart.
Root only (it drops the page cache).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from common import ROOT, drop_caches, emit, read_trace, run_env, timed  # this directory

import elf  # this directory


def resident_pages(path: str | os.PathLike) -> bytes | None:
    """One byte per page of the file, bit 0 set where the page is in the page cache (mincore on a map of it, which
    reads none of them); None where that cannot be asked, or for an empty file."""
    import ctypes
    import mmap

    size = os.path.getsize(path)
    if not size:
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    fd = os.open(path, os.O_RDONLY)
    try:
        address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if address in (None, ctypes.c_void_p(-1).value):
            return None
        try:
            vec = (ctypes.c_ubyte * -(-size // mmap.PAGESIZE))()
            return bytes(vec) if libc.mincore(address, size, vec) == 0 else None
        finally:
            libc.munmap(address, size)
    finally:
        os.close(fd)

PAGE = os.sysconf("SC_PAGE_SIZE")
SYSTEM_LIBS = ("/usr/lib/x86_64-linux-gnu", "/lib/x86_64-linux-gnu", "/usr/local/cuda/lib64", "/usr/local/lib")
DEVICE_CODE = (".nv_fatbin", "__nv_relfatbin", ".nvFatBinSegment")  # CUDA reads it kernel by kernel, not the loader


def roots() -> list[Path]:
    """The folders a start-up reads from: the interpreter's paths, the pycache prefix, the system's libraries."""
    found = [Path(p) for p in sys.path if p and Path(p).is_dir()]
    found += [Path(sysconfig.get_paths()[k]) for k in ("stdlib", "platstdlib", "purelib", "platlib")]
    if os.environ.get("PYTHONPYCACHEPREFIX"):
        found.append(Path(os.environ["PYTHONPYCACHEPREFIX"]))
    found += [Path(p) for p in SYSTEM_LIBS]
    out: list[Path] = []
    for p in found:
        p = p.resolve()
        if p.is_dir() and p != ROOT and not any(p.is_relative_to(q) for q in out):
            out = [q for q in out if not q.is_relative_to(p)] + [p]
    return out


def resident_files(folders: list[Path]) -> dict[str, bytes]:
    """Every regular file under `folders` with a page in the page cache: path -> its mincore vector."""
    seen, found = set(), {}
    for folder in folders:
        for dirpath, _dirs, names in os.walk(folder):
            for name in names:
                path = os.path.join(dirpath, name)
                try:
                    real = os.path.realpath(path)
                    if real in seen or not os.path.isfile(real):
                        continue
                    seen.add(real)
                    pages = resident_pages(real)
                except OSError:
                    continue
                if pages and any(pages):
                    found[real] = pages
    return found


def group(path: str) -> str:
    """The group a file counts in: torch/lib, nvidia/<package>, bitsandbytes, python (.py/.pyc), system, other."""
    parts = Path(path).parts
    if path.endswith((".py", ".pyc")):
        return "python"
    if "nvidia" in parts:
        i = parts.index("nvidia")
        return "nvidia/" + (parts[i + 1] if i + 1 < len(parts) else "?")
    if any(a == "torch" and b == "lib" for a, b in zip(parts, parts[1:])):
        return "torch/lib"
    if "bitsandbytes" in parts and ".so" in path:
        return "bitsandbytes/lib"
    if path.startswith(SYSTEM_LIBS) or path.startswith("/usr/lib/"):
        return "system"
    return "other"


def describe(found: dict[str, bytes]) -> dict:
    """Resident bytes by group, and each touched file with its size, resident bytes and ELF breakdown."""
    groups: dict[str, dict] = defaultdict(lambda: {"files": 0, "resident": 0, "size": 0})
    files = []
    for path, pages in found.items():
        size = os.path.getsize(path)
        resident = sum(1 for p in pages if p & 1) * PAGE
        g = groups[group(path)]
        g["files"] += 1
        g["resident"] += resident
        g["size"] += size
        row = {"path": path, "size": size, "resident": resident}
        secs = elf.sections(path) if size > 1 << 20 else None
        if secs:
            def res(s: elf.Section) -> int:
                return sum(1 for i in range(s.offset // PAGE, -(-(s.offset + s.size) // PAGE))
                           if i < len(pages) and pages[i] & 1) * PAGE
            code = [s for s in secs if s.name in DEVICE_CODE]
            mapped = [s for s in secs if s.alloc and s.name not in DEVICE_CODE]
            row.update(mapped=sum(s.size for s in mapped), mapped_resident=sum(map(res, mapped)),
                       device_code=sum(s.size for s in code), device_code_resident=sum(map(res, code)))
        files.append(row)
    files.sort(key=lambda r: -r["resident"])
    return {"groups": dict(sorted(groups.items(), key=lambda kv: -kv[1]["resident"])), "files": files}


def ranges(found: dict[str, bytes]) -> list[tuple[str, int, int]]:
    """(path, offset, bytes) to read: each file's runs of resident pages."""
    out = []
    for path, pages in found.items():
        start = None
        for i, p in enumerate([*pages, 0]):
            if p & 1 and start is None:
                start = i
            elif not p & 1 and start is not None:
                out.append((path, start * PAGE, (i - start) * PAGE))
                start = None
    return out


def read_ahead(todo: list[tuple[str, int, int]], threads: int = 8) -> tuple[float, int]:
    """Read the ranges on `threads` threads, in 8 MiB reads: seconds, bytes."""
    def one(item: tuple[str, int, int]) -> int:
        path, offset, n = item
        got = 0
        fd = os.open(path, os.O_RDONLY)
        try:
            while got < n:
                b = os.pread(fd, min(8 << 20, n - got), offset + got)
                if not b:
                    break
                got += len(b)
        finally:
            os.close(fd)
        return got

    t = time.monotonic()
    with ThreadPoolExecutor(threads) as pool:
        total = sum(pool.map(one, sorted(todo, key=lambda r: -r[2])))
    return time.monotonic() - t, total


def convert(tiny: Path, out: Path, device: str, work: Path, env: dict | None = None) -> dict:
    """One whole conversion of the tiny checkpoint: wall seconds and its trace's events."""
    shutil.rmtree(out, ignore_errors=True)
    trace = work / "trace.json"
    trace.unlink(missing_ok=True)
    spawned = time.time()
    r = timed([sys.executable, "-m", "prequant", "convert", str(tiny), str(out), "--device", device],
              env=run_env(PREQUANT_TRACE=str(trace), **(env or {})), memory=False)
    events = read_trace(trace, spawned).get("events", {})
    keep = ("start", "imported", "cuda-ready", "quantizer-ready", "quantizer-started", "pipeline-start", "exit")
    return {"seconds": r["seconds"], "events": {k: v for k, v in events.items() if k in keep}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="prequant-cold-start-"))
    report: dict = {"device": args.device, "runs": defaultdict(list)}
    try:
        tiny = work / "tiny"
        subprocess.run([sys.executable, str(ROOT / "scripts" / "make_tiny_checkpoint.py"), str(tiny)], check=True,
                       capture_output=True)
        convert(tiny, work / "out", args.device, work)  # bytecode compiled (PYTHONPYCACHEPREFIX) once, untimed
        if not drop_caches():
            raise SystemExit("cold_start.py drops the page cache: run it as root")
        report["runs"]["cold"].append(convert(tiny, work / "out", args.device, work))
        t = time.monotonic()
        found = resident_files(roots())
        report["scan_seconds"] = round(time.monotonic() - t, 1)
        report["touched"] = describe(found)
        for i in range(args.repeats):
            report["runs"]["warm"].append(convert(tiny, work / "out", args.device, work))
            drop_caches()
            seconds, n = read_ahead(ranges(found))
            r = convert(tiny, work / "out", args.device, work)
            report["runs"]["touched"].append(r | {"read_seconds": round(seconds, 2), "read_bytes": n})
            if i:
                drop_caches()
                report["runs"]["cold"].append(convert(tiny, work / "out", args.device, work))
            emit(report, args.json)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    emit(report, args.json)
    for name, g in report["touched"]["groups"].items():
        print(f"{name:28} {g['files']:5} files, {g['resident'] / 1e6:8.1f} MB resident of {g['size'] / 1e6:8.1f} MB",
              file=sys.stderr)
    for mode, runs in report["runs"].items():
        for r in runs:
            extra = f" (read first: {r['read_bytes'] / 1e9:.2f} GB in {r['read_seconds']:.2f} s)" if "read_bytes" in r else ""
            print(f"{mode:9} {r['seconds']:6.2f} s{extra}  {r['events']}", file=sys.stderr)


if __name__ == "__main__":
    main()
