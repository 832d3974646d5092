#!/usr/bin/env python3
"""Where the CPU kernel's threads wait: the figures behind its design, measured on this machine.

Four measurements, each against the same machine's one-thread figure:

1. ``ops``: single numpy/torch operations of the kernel (a product, a shift, a compare, the table lookup)
   on buffers of 4 Ki, 64 Ki and 1 Mi elements, run by 1..N threads at once, each on its own buffers.
   If small buffers stop scaling and large ones scale, the threads wait for the GIL (each call holds it
   for its Python part); if large ones stop scaling too, they wait for memory or share cores.
2. ``kernel``: `quantize_4bit` on one tensor with the pool at 1..N threads, for several piece sizes.
3. ``processes``: the same kernel in N worker processes (one thread each, no shared GIL) on slices of
   one shared-memory tensor: what the machine gives when nothing is shared but memory.
4. ``topology``: which logical CPUs share a core (hyperthreads count as one core for SIMD work).

    python scripts/bench/profile_cpu_kernel.py --threads 1,2,4,8,16 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

import common  # noqa: F401 - this directory: puts this checkout's prequant first on sys.path


def topology() -> dict:
    cores = set()
    for cpu in sorted(Path("/sys/devices/system/cpu").glob("cpu[0-9]*")):
        siblings = cpu / "topology" / "thread_siblings_list"
        if siblings.exists():
            cores.add(siblings.read_text().strip())
    model = ""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"logical_cpus": os.cpu_count(), "physical_cores": len(cores), "siblings": sorted(cores), "model": model}


def ops(threads: list[int], seconds: float) -> list[dict]:
    import numpy as np
    import torch

    torch.set_num_threads(1)

    def buffers(n: int):
        a = np.random.rand(n).astype(np.float32)
        return {
            "a": a, "b": np.empty_like(a), "keys": torch.randint(0, 65535, (n,), dtype=torch.int32),
            "table": torch.randint(0, 255, (65536,), dtype=torch.uint8), "out": torch.empty(n, dtype=torch.uint8),
        }  # fmt: skip

    calls = {
        "multiply": lambda d: np.multiply(d["a"], np.float32(1.5), out=d["b"]),
        "right_shift": lambda d: np.right_shift(d["a"].view(np.uint32), 16, out=d["b"].view(np.uint32)),
        "greater": lambda d: np.greater(d["a"], d["b"], out=d["out"].numpy().view(np.bool_)),
        "index_select": lambda d: torch.index_select(d["table"], 0, d["keys"], out=d["out"]),
    }
    rows = []
    for name, call in calls.items():
        for n in (1 << 12, 1 << 16, 1 << 18, 1 << 20):
            base = None
            for t in threads:
                data = [buffers(n) for _ in range(t)]
                call(data[0])
                start = time.perf_counter()
                reps = max(3, int(2e7 // n))
                counts = [0] * t
                stop = threading.Event()

                def work(i: int) -> None:
                    d = data[i]
                    while not stop.is_set():
                        for _ in range(reps):
                            call(d)
                        counts[i] += reps

                ths = [threading.Thread(target=work, args=(i,)) for i in range(t)]
                cpu0 = time.process_time()
                for th in ths:
                    th.start()
                time.sleep(seconds)
                stop.set()
                for th in ths:
                    th.join()
                wall = time.perf_counter() - start
                cpu = time.process_time() - cpu0
                rate = sum(counts) * n / wall / 1e9
                base = base or rate
                rows.append({"op": name, "elements": n, "threads": t, "gelem_per_s": round(rate, 3),
                             "speedup": round(rate / base, 2), "cpu_per_wall": round(cpu / wall, 2)})  # fmt: skip
                print(f"ops {name:12s} n={n:8d} t={t:2d} {rate:7.3f} Gelem/s x{rate / base:5.2f} "
                      f"cpu/wall {cpu / wall:5.2f}", file=sys.stderr, flush=True)  # fmt: skip
    return rows


def kernel(shape: tuple[int, int], threads: list[int], pieces: list[int], task_pieces: list[int],
           repeats: int) -> list[dict]:
    import torch

    from prequant.bnb.kernels import _parallel, cpu

    x = torch.randn(*shape, dtype=torch.bfloat16)
    rows = []
    task_default = cpu.TASK_ELEMENTS
    for piece in pieces:
        for tp in task_pieces:
            # piece 0: the kernel's own rule (pieces follow the thread count, `cpu._chunk_elements`)
            cpu.CHUNK_ELEMENTS, cpu.TASK_ELEMENTS = (piece or None), (piece * tp if piece else task_default)
            base = None
            for t in threads:
                torch.set_num_threads(t)
                _parallel.THREADS = t
                cpu.quantize_4bit(x, quant_type="nf4", blocksize=64)
                best, cpu_s = None, 0.0
                for _ in range(repeats):
                    c0, w0 = time.process_time(), time.perf_counter()
                    cpu.quantize_4bit(x, quant_type="nf4", blocksize=64)
                    wall = time.perf_counter() - w0
                    if best is None or wall < best:
                        best, cpu_s = wall, time.process_time() - c0
                gbps = x.numel() * 2 / best / 1e9
                base = base or gbps
                rows.append({"piece": piece, "task_pieces": tp, "threads": t, "gbps": round(gbps, 3),
                             "speedup": round(gbps / base, 2), "cpu_per_wall": round(cpu_s / best, 2)})  # fmt: skip
                print(f"kernel piece={piece:8d} task_pieces={tp:2d} t={t:2d} {gbps:6.3f} GB/s x{gbps / base:5.2f} "
                      f"cpu/wall {cpu_s / best:5.2f}", file=sys.stderr, flush=True)  # fmt: skip
    _parallel.THREADS = None
    cpu.CHUNK_ELEMENTS, cpu.TASK_ELEMENTS = None, task_default
    return rows


def stats(shape: tuple[int, int], threads: list[int], tasks: list[int], repeats: int) -> list[dict]:
    import torch

    import prequant
    from prequant.bnb import stats as bnb_stats
    from prequant.bnb.kernels import _compare, _parallel

    x = (torch.randn(*shape) * 0.02).to(torch.bfloat16)
    entries = prequant.quantize_tensor(x)
    rows = []
    for task in tasks:
        _compare.TASK_ELEMENTS = task
        base = None
        for t in threads:
            torch.set_num_threads(t)
            _parallel.THREADS = t
            bnb_stats.entry_stats(x, entries)
            best = min(_timed(lambda: bnb_stats.entry_stats(x, entries)) for _ in range(repeats))
            gbps = x.numel() * 2 / best / 1e9
            base = base or gbps
            rows.append({"task": task, "threads": t, "gbps": round(gbps, 3), "speedup": round(gbps / base, 2)})
            print(f"stats task={task:8d} t={t:2d} {gbps:6.3f} GB/s x{gbps / base:5.2f}", file=sys.stderr, flush=True)
    _parallel.THREADS = None
    return rows


def nested(shape: tuple[int, int], threads: list[int], repeats: int) -> list[dict]:
    import torch

    from prequant.bnb.kernels import _parallel, cpu

    absmax = torch.rand(shape[0] * shape[1] // 64) * 0.1
    rows = []
    for t in threads:
        torch.set_num_threads(t)
        _parallel.THREADS = t
        cpu.quantize_nested(absmax)
        best = min(_timed(lambda: cpu.quantize_nested(absmax)) for _ in range(repeats))
        rows.append({"threads": t, "ms": round(best * 1e3, 2)})
        print(f"nested values={absmax.numel()} t={t:2d} {best * 1e3:7.2f} ms", file=sys.stderr, flush=True)
    _parallel.THREADS = None
    return rows


def _timed(call) -> float:
    t0 = time.perf_counter()
    call()
    return time.perf_counter() - t0


def _worker(x, lo: int, hi: int, start, done, repeats: int, times) -> None:
    import torch

    torch.set_num_threads(1)
    from prequant.bnb.kernels import _parallel, cpu

    _parallel.THREADS = 1
    part = x.view(-1)[lo:hi]
    cpu.quantize_4bit(part[: 1 << 16], quant_type="nf4", blocksize=64)  # tables built before the clock
    for r in range(repeats):
        start.wait()
        t0 = time.perf_counter()
        cpu.quantize_4bit(part, quant_type="nf4", blocksize=64)
        times.put((r, time.perf_counter() - t0))
        done.wait()


def processes(shape: tuple[int, int], counts: list[int], repeats: int) -> list[dict]:
    import torch
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    x = torch.randn(*shape, dtype=torch.bfloat16).share_memory_()
    n = x.numel()
    rows, base = [], None
    for p in counts:
        step = -(-n // p // 4096) * 4096
        start, done, times = ctx.Barrier(p + 1), ctx.Barrier(p + 1), ctx.Queue()
        workers = [ctx.Process(target=_worker, args=(x, i * step, min(n, (i + 1) * step), start, done, repeats, times))
                   for i in range(p)]  # fmt: skip
        for w in workers:
            w.start()
        best = None
        for _ in range(repeats):
            start.wait()
            t0 = time.perf_counter()
            for _ in range(p):
                times.get()
            wall = time.perf_counter() - t0
            done.wait()
            best = wall if best is None else min(best, wall)
        for w in workers:
            w.join()
        gbps = n * 2 / best / 1e9
        base = base or gbps
        rows.append({"processes": p, "gbps": round(gbps, 3), "speedup": round(gbps / base, 2)})
        print(f"processes p={p:2d} {gbps:6.3f} GB/s x{gbps / base:5.2f}", file=sys.stderr, flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="14336x4096", help="the bf16 weight of kernel, stats, nested and processes")
    ap.add_argument("--threads", default="1,2,4,8,16")
    ap.add_argument("--seconds", type=float, default=0.3, help="per (op, size, threads) in `ops`")
    ap.add_argument("--pieces", default="0,65536,262144,1048576", help="0: the kernel's own rule")
    ap.add_argument("--piece-cap", type=int, help="the largest piece of the kernel's own rule")
    ap.add_argument("--task-pieces", default="4")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--stats-tasks", default="131072,524288,1048576")
    ap.add_argument("--only", default="topology,ops,kernel,stats,nested,processes")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    threads = [int(t) for t in a.threads.split(",")]
    rows, cols = (int(v) for v in a.shape.lower().split("x"))
    shape = (rows, cols)
    only = set(a.only.split(","))
    out: dict = {}
    if "topology" in only:
        out["topology"] = topology()
        print(json.dumps(out["topology"]), file=sys.stderr, flush=True)
    if "ops" in only:
        out["ops"] = ops(threads, a.seconds)
    if a.piece_cap:
        from prequant.bnb.kernels import cpu

        cpu.PIECE_CAP = a.piece_cap
    if "kernel" in only:
        out["kernel"] = kernel(shape, threads, [int(p) for p in a.pieces.split(",")],
                               [int(p) for p in a.task_pieces.split(",")], a.repeats)  # fmt: skip
    if "stats" in only:
        out["stats"] = stats(shape, threads, [int(p) for p in a.stats_tasks.split(",")], a.repeats)
    if "nested" in only:
        out["nested"] = nested(shape, threads, a.repeats)
    if "processes" in only:
        out["processes"] = processes(shape, threads, a.repeats)
    text = json.dumps(out, indent=1)
    if a.json:
        a.json.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
