#!/usr/bin/env python3
"""Benchmark prequant's CPU 4-bit kernel against bitsandbytes' own CPU path.

Both quantize the same bf16 tensors to NF4 with double quantization, blocksize 64 (what transformers
does with bnb_4bit_use_double_quant=True). Each (implementation, shape) runs in a fresh subprocess so
that its peak memory is its own: the script reports GB/s of bf16 input, the speed ratio, and the peak
resident memory the quantization added on top of the input tensor (outputs included).

    python scripts/bench_cpu_kernel.py                  # 4096x4096 and 14336x4096
    python scripts/bench_cpu_kernel.py --json           # machine-readable
    python scripts/bench_cpu_kernel.py --shapes 1024x1024 --repeats 5
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

IMPLEMENTATIONS = ("prequant", "bitsandbytes")
MIB = 2**20


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _hwm_bytes() -> int | None:
    """Peak resident set (VmHWM) of this process, or None where /proc does not say."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _reset_hwm() -> bool:
    """Reset VmHWM to the current RSS (Linux: write 5 to clear_refs); False where not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class _PeakSampler:
    """Fallback peak-RSS meter: samples /proc/self/statm every millisecond in a thread."""

    def __init__(self) -> None:
        self.peak = _rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss_bytes())
            time.sleep(0.001)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_bytes())
        return self.peak


def _quantizer(impl: str):
    """A function bf16 tensor -> outputs, for one implementation (NF4, double quant, blocksize 64)."""
    import torch

    if impl == "prequant":
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        from prequant.bnb.kernels import cpu

        def run(x: torch.Tensor):
            packed, absmax = cpu.quantize_4bit(x, quant_type="nf4", blocksize=64)
            return packed, cpu.quantize_nested(absmax, blocksize=256)

        return run
    import logging

    logging.disable(logging.WARNING)  # bitsandbytes' CPU backend warns about optional kernels
    import bitsandbytes.functional as bnb

    def run(x: torch.Tensor):
        return bnb.quantize_4bit(x, blocksize=64, quant_type="nf4", compress_statistics=True, quant_storage=torch.uint8)

    return run


def child(impl: str, shape: tuple[int, int], repeats: int, threads: int | None) -> dict:
    """Runs in the subprocess: time `repeats` quantizations and measure the peak memory they add."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    run = _quantizer(impl)
    x = (torch.randn(*shape, generator=torch.Generator().manual_seed(0)) * 0.02).to(torch.bfloat16)
    run(x[:2, :64].contiguous())  # warm up: imports, lazily built tables
    gc.collect()
    base = _rss_bytes()
    exact_peak = _reset_hwm()
    times, cpu_times = [], []
    sampler = _PeakSampler()
    sampler.start()
    for _ in range(repeats):
        start, cpu_start = time.perf_counter(), time.process_time()
        out = run(x)
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)
        del out
        gc.collect()
    sampled_peak = sampler.stop()
    peak = (_hwm_bytes() if exact_peak else None) or sampled_peak
    n = x.numel()
    return {
        "impl": impl,
        "shape": list(shape),
        "elements": n,
        "threads": torch.get_num_threads(),
        "seconds": times,
        "cpu_seconds": cpu_times,
        "best_gbps": n * 2 / min(times) / 1e9,
        "median_gbps": n * 2 / statistics.median(times) / 1e9,
        # Bytes per CPU-second (all threads): less sensitive to other load on the machine than wall time.
        "gb_per_cpu_second": n * 2 / min(cpu_times) / 1e9,
        "peak_extra_mib": (peak - base) / MIB,
        "input_mib": n * 2 / MIB,
        "peak_method": "VmHWM" if exact_peak else "RSS sampling (1 ms)",
    }


def _run_child(impl: str, shape: tuple[int, int], repeats: int, threads: int | None) -> dict:
    cmd = [sys.executable, __file__, "--child", impl, "--shapes", f"{shape[0]}x{shape[1]}", "--repeats", str(repeats)]
    if threads:
        cmd += ["--threads", str(threads)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{impl} {shape} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _parse_shapes(text: str) -> list[tuple[int, int]]:
    return [tuple(int(v) for v in item.split("x")) for item in text.split(",")]  # type: ignore[misc]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="4096x4096,14336x4096", help="comma-separated ROWSxCOLS (bf16)")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per implementation and shape")
    ap.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's, one per core)")
    ap.add_argument("--json", action="store_true", help="print one JSON document instead of a table")
    ap.add_argument("--child", choices=IMPLEMENTATIONS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    shapes = _parse_shapes(args.shapes)
    if args.child:
        print(json.dumps(child(args.child, shapes[0], args.repeats, args.threads)))
        return

    rows = []
    for shape in shapes:
        result = {impl: _run_child(impl, shape, args.repeats, args.threads) for impl in IMPLEMENTATIONS}
        ratio = result["prequant"]["best_gbps"] / result["bitsandbytes"]["best_gbps"]
        cpu_ratio = result["prequant"]["gb_per_cpu_second"] / result["bitsandbytes"]["gb_per_cpu_second"]
        rows.append({"shape": list(shape), **result, "speedup_best": ratio, "speedup_per_cpu_second": cpu_ratio})
    report = {"cpus": os.cpu_count(), "loadavg_before": os.getloadavg(), "results": rows}
    if args.json:
        print(json.dumps(report, indent=2))
        return
    threads = rows[0]["prequant"]["threads"]
    print(
        f"NF4, double quant, blocksize 64, bf16 input; {threads} threads on {os.cpu_count()} CPUs; load {os.getloadavg()[0]:.2f}"
    )
    head = (
        f"{'shape':>12} {'impl':>13} {'best GB/s':>10} {'median GB/s':>12} {'GB/CPU-s':>9} "
        f"{'peak extra MiB':>15} {'input MiB':>10}"
    )
    print(head)
    for row in rows:
        for impl in IMPLEMENTATIONS:
            r = row[impl]
            print(
                f"{'x'.join(map(str, row['shape'])):>12} {impl:>13} {r['best_gbps']:>10.3f} {r['median_gbps']:>12.3f} "
                f"{r['gb_per_cpu_second']:>9.3f} {r['peak_extra_mib']:>15.1f} {r['input_mib']:>10.1f}"
            )
        print(f"{'':>12} {'speedup':>13} {row['speedup_best']:>10.2f}x {'':>12} {row['speedup_per_cpu_second']:>8.2f}x")


if __name__ == "__main__":
    main()
