"""convert.py's Hub path: `prequant convert org/name OUT --delete-source-shards` from the project's local Hub server.

The server (tests/hub_server.py, the one the tests use) serves the generated checkpoint from the same disk,
its files hard-linked into its store (no copy, nothing read into memory). Measured, each from cold page cache:

  download      every file of the repo fetched with huggingface_hub (hf_hub_download) in a fresh process,
                each shard deleted once fetched: what the download alone costs, through the same client
  convert       prequant convert bench/NAME OUT --delete-source-shards: wall time, peak disk use beyond what
                was used before (sampled every 50 ms) against at most 2 source shards + the output, and
                whether the weight files' sha256 equal the local conversion's
  server        the local server's own throughput: the largest shard over HTTP to nowhere, warm page cache

and the ratio of the Hub conversion's wall time to max(download alone, the local conversion).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from common import ROOT, DiskUsagePeak, drop_caches, run_prequant

from prequant.checkpoint.manifest import sha256_file  # standard library only (common puts this checkout first)

REPO_PREFIX = "bench"
HASHES = ".bench-sha256.json"  # beside the generated checkpoint: its files' sha256, for the server

DOWNLOAD = r"""
import os, sys, time
from huggingface_hub import hf_hub_download, list_repo_files
repo, cache = sys.argv[1], sys.argv[2]
for name in list_repo_files(repo):
    path = hf_hub_download(repo, name, cache_dir=cache)
    if name.endswith((".safetensors", ".bin")):
        os.remove(os.path.realpath(path))  # as --delete-source-shards does: the disk holds one shard at a time
"""


def source_hashes(src: Path) -> dict[str, str]:
    """sha256 of every file of the checkpoint, computed once (in parallel) and kept beside it."""
    cached = src / HASHES
    if cached.is_file():
        return json.loads(cached.read_text())
    files = sorted(p for p in src.iterdir() if p.is_file() and p.name != HASHES)
    with ThreadPoolExecutor(max_workers=min(16, len(files) or 1)) as pool:  # hashlib releases the GIL: side by side
        hashes = dict(zip((p.name for p in files), pool.map(sha256_file, files)))
    cached.write_text(json.dumps(hashes, indent=1))
    return hashes


def measure(src: Path, args, report: dict) -> dict:
    """Serve `src` from a local Hub, then time download alone and the Hub conversion (see the module doc); `args`:
    convert.py's (--dir, --device, --warm-libraries, --prequant-arg), `report`: its local conversion's."""
    sys.path.insert(0, str(ROOT / "tests"))
    from hub_server import HubServer  # the tests' local Hub (it imports pytest, a test dependency)

    repo = f"{REPO_PREFIX}/{src.name}"
    hashes = source_hashes(src)
    server_root, hf_home = args.dir / "hub-server", args.dir / "hub-hf-home"
    shutil.rmtree(server_root, ignore_errors=True)
    files = {p.name: p for p in sorted(src.iterdir()) if p.is_file() and p.name != HASHES}
    shards = [p for p in files.values() if p.suffix == ".safetensors"]
    with HubServer(server_root) as server:
        server.add_repo(repo, files, link=True, sha256s=hashes)
        hub_env = {**server.env, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "0",
                   "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}  # fmt: skip
        out: dict = {"repo": repo, "files": len(files), "largest_shard_bytes": max(p.stat().st_size for p in shards),
                     "filesystem": filesystem(args.dir)}
        shutil.rmtree(hf_home, ignore_errors=True)
        drop_caches()
        start = time.monotonic()
        subprocess.run([sys.executable, "-c", DOWNLOAD, repo, str(hf_home / "hub")], check=True,
                       env={**os.environ, **hub_env})
        out["download_seconds"] = round(time.monotonic() - start, 2)
        shutil.rmtree(hf_home, ignore_errors=True)

        drop_caches(args.warm_libraries)
        disk = DiskUsagePeak(args.dir)
        converted = run_prequant(repo, args.dir / "out-hub", args.device, args.dir,
                                 [*args.prequant_arg, "--delete-source-shards"], hub_env)
        converted["peak_disk_extra_bytes"] = disk.stop()
        converted["disk_bound_bytes"] = 2 * out["largest_shard_bytes"] + converted["output_bytes"]
        converted["within_disk_bound"] = converted["peak_disk_extra_bytes"] <= converted["disk_bound_bytes"]
        converted["same_bytes"] = converted["weight_sha256"] == report["prequant"]["weight_sha256"]
        out["convert"] = converted
        shutil.rmtree(args.dir / "out-hub", ignore_errors=True)
        shutil.rmtree(hf_home, ignore_errors=True)
        out["server_gbps"] = _server_throughput(server, repo, max(shards, key=lambda p: p.stat().st_size).name)
    local = report["prequant"]["seconds"]
    out["ratio_to_max_download_local"] = round(converted["seconds"] / max(out["download_seconds"], local), 3)
    out["download_gbps"] = round(report["source_bytes"] / out["download_seconds"] / 1e9, 3)
    shutil.rmtree(server_root, ignore_errors=True)
    return out


def filesystem(path: Path) -> str:
    """The file system type of `path` (stat -f): statvfs counts what it allocates, e.g. XFS's speculative
    preallocation beyond the end of a file being extended (as much again as the file, up to 8 GiB, until it
    is closed or truncated), so the peak disk figure is read with it."""
    done = subprocess.run(["stat", "-f", "-c", "%T", str(path)], capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


def _server_throughput(server, repo: str, name: str) -> float:
    """GB/s of one file's body from the local server (page cache warm: the server's cost, not the disk's)."""
    url = f"{server.url}/{repo}/resolve/main/{name}"
    with urllib.request.urlopen(url) as r:  # warm the page cache (and follow the LFS redirect)
        while r.read(1 << 24):
            pass
    start, total = time.monotonic(), 0
    with urllib.request.urlopen(url) as r:
        while chunk := r.read(1 << 24):
            total += len(chunk)
    return round(total / (time.monotonic() - start) / 1e9, 3)


def print_report(h: dict) -> None:
    c = h["convert"]
    print(f"hub path ({h['repo']}, {h['files']} files): download alone {h['download_seconds']:.1f} s "
          f"({h['download_gbps']:.2f} GB/s), prequant convert --delete-source-shards {c['seconds']:.1f} s = "
          f"{h['ratio_to_max_download_local']:.2f}x max(download, local convert); peak extra disk "
          f"{c['peak_disk_extra_bytes'] / 1e9:.2f} GB on {h.get('filesystem', '?')} (bound: 2 shards + output = "
          f"{c['disk_bound_bytes'] / 1e9:.2f} GB); "
          f"same bytes as local: {c['same_bytes']}; local server alone {h['server_gbps']:.2f} GB/s", file=sys.stderr)
