#!/usr/bin/env python3
"""Benchmark prequant's CPU 4-bit kernel against bitsandbytes' own CPU path.

Both quantize the same bf16 tensors to NF4 with double quantization, blocksize 64 (what transformers
does with bnb_4bit_use_double_quant=True). Each (implementation, shape, thread count) runs in a fresh
subprocess so that its peak memory is its own: the script reports GB/s of bf16 input (wall and per
CPU-second), the speed ratio to bitsandbytes measured in the same run, the peak resident memory the
quantization added on top of the input tensor (outputs included), and for prequant also the speed of its
error statistics (`bnb.stats`, which a conversion computes for every tensor on the quantizing device).
With several thread counts it adds each count's scaling efficiency: GB/s / (threads x GB/s on one thread).

    python scripts/bench/cpu_kernel.py                             # 4096x4096 and 14336x4096, torch's threads
    python scripts/bench/cpu_kernel.py --shapes 14336x4096 --repeats 2 --threads 1,2,4,8,16
    python scripts/bench/cpu_kernel.py --json                      # machine-readable
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time

from common import Periodic, run_env, status_bytes  # this directory

# prequant: its kernel on the thread pool; bitsandbytes: its own CPU path.
IMPLEMENTATIONS = ("prequant", "bitsandbytes")
MIB = 2**20


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _hwm_bytes() -> int | None:
    """Peak resident set (VmHWM) of this process, or None where /proc does not say."""
    return (status_bytes("self", ("VmHWM",)) or {}).get("VmHWM") or None


def _reset_hwm() -> bool:
    """Reset VmHWM to the current RSS (Linux: write 5 to clear_refs); False where not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class _PeakSampler(Periodic):
    """Fallback peak-RSS meter: samples /proc/self/statm every millisecond in a thread."""

    def __init__(self) -> None:
        self.peak = _rss_bytes()
        super().__init__(0.001)

    def sample(self) -> None:
        self.peak = max(self.peak, _rss_bytes())

    def stop(self) -> int:
        self._halt()
        self.peak = max(self.peak, _rss_bytes())
        return self.peak


def _quantizer(impl: str):
    """A function bf16 tensor -> outputs, for one implementation (NF4, double quant, blocksize 64)."""
    import torch

    if impl.startswith("prequant"):
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
    extra = _stats_speed(x, repeats) if impl.startswith("prequant") else {}
    return {**extra,
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


def _stats_speed(x, repeats: int) -> dict:
    """GB/s (wall, and per CPU-second) of prequant's error statistics on the tensor's quantized entries."""
    import prequant
    from prequant.bnb import stats

    entries = prequant.quantize_tensor(x)
    stats.entry_stats(x[:2, :64].contiguous(), prequant.quantize_tensor(x[:2, :64].contiguous()))
    times, cpu_times = [], []
    for _ in range(repeats):
        start, cpu_start = time.perf_counter(), time.process_time()
        stats.entry_stats(x, entries)
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)
    gb = x.numel() * x.element_size() / 1e9
    return {"stats_best_gbps": gb / min(times), "stats_gb_per_cpu_second": gb / min(cpu_times)}


def _run_child(impl: str, shape: tuple[int, int], repeats: int, threads: int | None) -> dict:
    cmd = [sys.executable, __file__, "--child", impl, "--shapes", f"{shape[0]}x{shape[1]}", "--repeats", str(repeats)]
    if threads:
        cmd += ["--threads", str(threads)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False, env=run_env())
    if done.returncode != 0:
        raise RuntimeError(f"{impl} {shape} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _parse_shapes(text: str) -> list[tuple[int, int]]:
    return [tuple(int(v) for v in item.split("x")) for item in text.split(",")]  # type: ignore[misc]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="4096x4096,14336x4096", help="comma-separated ROWSxCOLS (bf16)")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per implementation and shape")
    ap.add_argument("--threads", help="comma-separated thread counts, e.g. 1,2,4,8,16 (default: torch's, one per core)")
    ap.add_argument("--json", action="store_true", help="print one JSON document instead of a table")
    ap.add_argument("--child", choices=IMPLEMENTATIONS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    shapes = _parse_shapes(args.shapes)
    counts = [int(t) for t in args.threads.split(",")] if args.threads else [None]
    if args.child:
        print(json.dumps(child(args.child, shapes[0], args.repeats, counts[0])))
        return

    loadavg = os.getloadavg()
    rows = []
    for shape in shapes:
        single: dict[str, float] = {}
        for threads in counts:
            result = {impl: _run_child(impl, shape, args.repeats, threads) for impl in IMPLEMENTATIONS}
            ratio = result["prequant"]["best_gbps"] / result["bitsandbytes"]["best_gbps"]
            cpu_ratio = result["prequant"]["gb_per_cpu_second"] / result["bitsandbytes"]["gb_per_cpu_second"]
            row = {"shape": list(shape), "threads": result["prequant"]["threads"], **result,
                   "speedup_best": ratio, "speedup_per_cpu_second": cpu_ratio}
            if row["threads"] == 1:
                single = {impl: result[impl]["best_gbps"] for impl in IMPLEMENTATIONS}
            for impl in IMPLEMENTATIONS:
                if single:  # scaling efficiency against this run's one-thread figure
                    result[impl]["efficiency"] = result[impl]["best_gbps"] / (row["threads"] * single[impl])
            rows.append(row)
    report = {"cpus": os.cpu_count(), "loadavg_before": loadavg, "loadavg_after": os.getloadavg(), "results": rows}
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"NF4, double quant, blocksize 64, bf16 input; {os.cpu_count()} CPUs; load {loadavg[0]:.2f} before, "
          f"{os.getloadavg()[0]:.2f} after")
    print(f"{'shape':>12} {'threads':>7} {'impl':>13} {'best GB/s':>10} {'median GB/s':>12} {'GB/CPU-s':>9} "
          f"{'efficiency':>10} {'peak extra MiB':>15} {'stats GB/s':>11}")
    for row in rows:
        for impl in IMPLEMENTATIONS:
            r = row[impl]
            eff = f"{r['efficiency']:.2f}" if "efficiency" in r else "-"
            st = f"{r['stats_best_gbps']:.3f}" if "stats_best_gbps" in r else ""
            print(f"{'x'.join(map(str, row['shape'])):>12} {row['threads']:>7} {impl:>13} {r['best_gbps']:>10.3f} "
                  f"{r['median_gbps']:>12.3f} {r['gb_per_cpu_second']:>9.3f} {eff:>10} {r['peak_extra_mib']:>15.1f} {st:>11}")
        print(f"{'':>12} {'':>7} {'ratio':>13} {row['speedup_best']:>9.2f}x {'':>12} {row['speedup_per_cpu_second']:>8.2f}x")


if __name__ == "__main__":
    main()
