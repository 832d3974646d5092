#!/usr/bin/env python3
"""How fast this machine hashes a shard: sha256 of the same bytes from memory, through a memory map of the page
cache (prequant's way for shards it just wrote, `checkpoint.manifest.sha256_file(mapped=True)`), and by read().

The last shard's hash is the tail of a conversion (it can start only once the shard's header is final), so
its speed bounds how close a run ends to the disk. Prints GB/s per way, best of --repeats.

    python scripts/bench_sha256.py --size-gb 2 --dir /tmp
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from prequant.checkpoint.manifest import sha256_file  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gb", type=float, default=1.0)
    ap.add_argument("--dir", type=Path, default=Path("/tmp"))
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    size = int(a.size_gb * 1e9) // 4096 * 4096
    block = os.urandom(1 << 24)
    path = a.dir / "bench-sha256.bin"
    with open(path, "wb") as f:
        for start in range(0, size, len(block)):
            f.write(block[: min(len(block), size - start)])
    memory = bytearray(block) * max(1, min(size, 1 << 30) // len(block))
    ways = {
        "memory": (len(memory), lambda: hashlib.sha256(memory).hexdigest()),
        "mapped": (size, lambda: sha256_file(path, mapped=True)),
        "read": (size, lambda: sha256_file(path)),
    }
    out: dict[str, float] = {}
    try:
        for name, (nbytes, call) in ways.items():
            best = min(_timed(call) for _ in range(a.repeats))
            out[name + "_gbps"] = round(nbytes / best / 1e9, 3)
            print(f"sha256 {name:7s} {nbytes / best / 1e9:6.3f} GB/s", file=sys.stderr)
    finally:
        path.unlink()
    print(json.dumps(out))


def _timed(call) -> float:
    t0 = time.perf_counter()
    call()
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()
