#!/usr/bin/env python3
"""Benchmark: a shard download beside the converting process' work, in this process and in a child process.

Serves one random file of --size-mb from the tests' local Hub server (tests/hub_server.py) and downloads it
with huggingface_hub (`prequant.hub.client.download`) four ways, each into a fresh cache, best of --repeats:

  alone        in this process, nothing else running (the baseline)
  in-process   in this process while --threads threads run the CPU 4-bit kernel on a bf16 tensor in a loop
               (what a `--device cpu` conversion does meanwhile)
  child        through `prequant.hub.fetcher.Fetcher` (a child process) while the same threads run
  child-alone  through the Fetcher, nothing else running

and prints each one's MB/s and its ratio to `alone`.

    python scripts/bench_fetch.py --size-mb 400 --threads 2
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mb", type=int, default=400)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads of the CPU kernel meanwhile")
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args()
    os.environ["HF_HUB_OFFLINE"] = "0"  # huggingface_hub reads it once, at import: the local server is the Hub here

    import torch

    from hub_server import HubServer  # the tests' local Hub (it imports pytest, a test dependency)
    from prequant.bnb.kernels import _parallel, cpu
    from prequant.hub import client
    from prequant.hub.fetcher import Fetcher

    work = Path(tempfile.mkdtemp(prefix="prequant-bench-fetch-"))
    name = "model.safetensors"
    x = torch.randn(4096, 4096, dtype=torch.bfloat16)
    torch.set_num_threads(max(1, a.threads))
    _parallel.THREADS = max(1, a.threads)
    try:
        with HubServer(work / "server") as server:
            size = a.size_mb * 10**6
            server.add_repo("bench/fetch", {"config.json": b"{}", name: os.urandom(size)})
            os.environ.update(HF_ENDPOINT=server.url, HF_HUB_DISABLE_PROGRESS_BARS="1")
            source = client.resolve("bench/fetch")

            def timed(in_child: bool, busy: bool) -> float:
                os.environ["HF_HOME"] = str(Path(tempfile.mkdtemp(dir=work)))  # a fresh cache, for the child too
                fetcher = Fetcher(source) if in_child else None
                if fetcher is not None:
                    fetcher.download("config.json")  # the child started and warm before the clock
                stop = threading.Event()

                def quantize_until_stopped() -> None:  # what a --device cpu conversion does meanwhile
                    while not stop.is_set():
                        cpu.quantize_4bit(x, quant_type="nf4", blocksize=64)

                load = threading.Thread(target=quantize_until_stopped, daemon=True)
                if busy:
                    load.start()
                t0 = time.perf_counter()
                path = fetcher.download(name) if fetcher is not None else client.download(source, name)
                seconds = time.perf_counter() - t0
                stop.set()
                if busy:
                    load.join()
                if fetcher is not None:
                    fetcher.close()
                assert path.stat().st_size == size
                shutil.rmtree(os.environ["HF_HOME"])
                return seconds

            ways = {"alone": (False, False), "in-process": (False, True), "child": (True, True),
                    "child-alone": (True, False)}  # fmt: skip
            best = {way: min(timed(*how) for _ in range(a.repeats)) for way, how in ways.items()}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    seconds = {way: round(s, 3) for way, s in best.items()}  # ratios of the figures printed
    report = {way: {"seconds": s, "mb_per_s": round(a.size_mb / s, 1), "ratio_to_alone": round(s / seconds["alone"], 2)}
              for way, s in seconds.items()}  # fmt: skip
    for way, r in report.items():
        print(f"{way:12s} {r['seconds']:7.2f} s  {r['mb_per_s']:8.1f} MB/s  x{r['ratio_to_alone']:.2f} of alone",
              file=sys.stderr)  # fmt: skip
    print(json.dumps({"size_mb": a.size_mb, "threads": a.threads, **report}))


if __name__ == "__main__":
    main()
