"""Benchmark: prequant convert against a cold read of the source and against transformers' path.

Generates a synthetic checkpoint of about --size-gb GB (Llama-8B-, Grok-1- or uniform 32 MiB-tensor
shapes, random bf16; bench_checkpoint.py), then in one run measures, each from cold page cache where permitted:

  read              cat every shard to /dev/null (how fast the disk gives us the source)
  read_write        the same cat while dd writes as many bytes as prequant's output and fsyncs them: the disk's
                    floor for any converter that reads the source and writes its result durably
  prequant          python -m prequant convert SRC OUT --device D (the whole process, start-up included), with
                    its own timeline (PREQUANT_TRACE: start-up, planning, pipeline, hashing; busy time per stage)
  prequant_also     --also-device D2: the same on another device (e.g. cpu), and whether its bytes are equal
  prequant_limited  --memory-limit-gib G: the same with torch capped at G GiB of GPU memory
                    (PREQUANT_CUDA_MEMORY_LIMIT, i.e. torch.cuda.set_per_process_memory_fraction), same bytes?
  hub               --hub: from the local Hub server with --delete-source-shards (bench_hub.py)
  transformers      from_pretrained(SRC, quantization_config=BitsAndBytesConfig(...)) + save_pretrained

and reports wall time, peak RssAnon / VmRSS (of the process and its children, sampled from /proc every 20 ms),
GPU memory (torch's peak reserved, and the process tree's own from NVML per process, bench_memory.py),
output size and each time's ratio to the cold read and to the read_write floor, as a table (stderr) and JSON
(stdout or --json FILE). Bytes are compared through the sha256 of the weight files in each prequant.json.

    python scripts/bench.py --size-gb 16 --shape llama --device cuda --transformers
    python scripts/bench.py --size-gb 16 --shape llama --device cuda --also-device cpu --warm-libraries
    python scripts/bench.py --size-gb 33 --shape grok --device cuda --memory-limit-gib 8 --hub
    python scripts/bench.py --size-gb 1 --shape uniform --device cpu
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import bench_hub  # this directory
from bench_checkpoint import SHAPES, generate  # noqa: F401 - generate: also for fsdp_gpu_check.sh
from bench_memory import GpuSampler, Sampler, process_tree

ROOT = Path(__file__).resolve().parent.parent
# What prequant's quantizer reads (prequant/bnb/quantize.py); spelled here so the bench runs without importing torch.
CUDA_MEMORY_LIMIT_ENV = "PREQUANT_CUDA_MEMORY_LIMIT"
PATHS = ("read", "read_write", "prequant", "prequant_also", "prequant_limited", "transformers")  # table rows

def drop_caches(warm_libraries: bool = False) -> bool:
    """Flush and drop the page cache so the next read comes from the disk; False when not permitted.

    `warm_libraries`: then import what both converters import (torch, CUDA, transformers, bitsandbytes) in
    a throwaway process, so only the checkpoint is cold, as on a machine that has run Python since boot."""
    try:
        subprocess.run(["sync"], check=True)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        return False
    if warm_libraries:
        subprocess.run([sys.executable, "-c", WARM_LIBRARIES], check=True, env=_env())
    return True


WARM_LIBRARIES = (
    "import torch, bitsandbytes.functional, transformers, prequant.cli, prequant.conversion.run\n"
    "from transformers import AutoModelForCausalLM, BitsAndBytesConfig, LlamaForCausalLM\n"
    "if torch.cuda.is_available(): torch.zeros(1, device='cuda')"
)


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def timed(cmd: list[str], env: dict | None = None, gpu: bool = False) -> dict:
    """Run a command, sampling its memory (and with `gpu` its own GPU memory, per process, from NVML);
    return wall time, peaks and its stdout."""
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    sampler = Sampler(proc.pid)
    gpu_sampler = GpuSampler(lambda: process_tree(proc.pid)) if gpu else None
    stdout, stderr = proc.communicate()
    wall = time.monotonic() - start
    peaks = sampler.join()
    gpu_peaks = gpu_sampler.stop() if gpu_sampler else {"peak_gpu_process_bytes": None, "gpu_process_match": None}
    if proc.returncode != 0:
        raise SystemExit(f"{cmd[:4]} failed ({proc.returncode}):\n{stderr[-3000:]}")
    return {"seconds": round(wall, 2), "peak_rss_anon": peaks["RssAnon"], "peak_rss_file": peaks["RssFile"],
            "peak_vm_rss": peaks["VmRSS"], **gpu_peaks, "stdout": stdout, "stderr_tail": stderr[-500:]}


def run_prequant(source: str, out: Path, args: argparse.Namespace, extra_env: dict | None = None,
                 extra_args: tuple[str, ...] = ()) -> dict:  # fmt: skip
    """`python -m prequant convert SOURCE OUT --json` as a whole process: wall, memory, GPU memory (torch's
    peak reserved and NVML's per process), output size, its trace and the sha256 of every weight file."""
    shutil.rmtree(out, ignore_errors=True)
    trace_file = args.dir / "prequant-trace.json"
    spawned = time.time()
    env = {**_env(), "PREQUANT_TRACE": str(trace_file), **(extra_env or {})}
    r = timed([sys.executable, "-m", "prequant", "convert", source, str(out), "--device", args.device, "--json",
               *args.prequant_arg, *extra_args], env=env, gpu=args.device != "cpu")
    r["trace"] = read_trace(trace_file, spawned)
    summary = json.loads(r.pop("stdout"))
    r["peak_gpu_bytes"] = summary.get("peak_gpu_bytes")  # torch's max_memory_reserved
    r["output_bytes"] = summary["output_bytes"]
    r["weight_sha256"] = weight_hashes(out)
    return r


def weight_hashes(out: Path) -> dict[str, str]:
    """sha256 of each weight file and the index, from the output's manifest (prequant.json): the bytes that
    must not depend on how the conversion ran (the card and manifest name the source and the run)."""
    files = json.loads((out / "prequant.json").read_text())["files"]
    return {name: f["sha256"] for name, f in sorted(files.items())
            if name.endswith(".safetensors") or name.endswith(".safetensors.index.json")}


TRANSFORMERS_PATH = r"""
import json, sys, time, torch
from transformers import AutoModelForCausalLM, BitsAndBytesConfig
src, out = sys.argv[1], sys.argv[2]
t = time.monotonic()
cfg = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                         bnb_4bit_compute_dtype=torch.bfloat16, bnb_4bit_quant_storage=torch.bfloat16)
model = AutoModelForCausalLM.from_pretrained(src, quantization_config=cfg, device_map="cuda", dtype=torch.bfloat16)
model.save_pretrained(out)
print(json.dumps({"load_save_seconds": time.monotonic() - t, "peak_gpu_bytes": torch.cuda.max_memory_allocated()}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gb", type=float, default=16)
    ap.add_argument("--shape", choices=list(SHAPES), default="llama")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dir", type=Path, default=Path("/tmp/prequant-bench"))
    ap.add_argument("--transformers", action="store_true", help="also measure transformers' path (needs a GPU)")
    ap.add_argument("--prequant-arg", action="append", default=[], metavar="ARG",
                    help="extra argument for prequant convert (repeatable), e.g. --prequant-arg=--no-stats")
    ap.add_argument("--warm-libraries", action="store_true",
                    help="cold checkpoint, warm Python libraries: import them after dropping the page cache")
    ap.add_argument("--also-device", metavar="DEVICE",
                    help="also convert on DEVICE (e.g. cpu beside --device cuda), same checkpoint and floor")
    ap.add_argument("--memory-limit-gib", type=float, metavar="GIB",
                    help=f"convert again with torch capped at GIB on the GPU ({CUDA_MEMORY_LIMIT_ENV}), same bytes?")
    ap.add_argument("--hub", action="store_true",
                    help="also convert from the local Hub server (tests/hub_server.py) serving the checkpoint, with "
                         "--delete-source-shards, against download alone and the local conversion (bench_hub.py)")
    ap.add_argument("--keep", action="store_true", help="keep the generated checkpoint and outputs")
    ap.add_argument("--json", type=Path, help="write the JSON report here (default: stdout)")
    args = ap.parse_args()

    src = args.dir / f"{args.shape}-{args.size_gb:g}gb"
    if not (src / "config.json").exists():
        t = time.monotonic()
        generate(args.shape, args.size_gb, src)
        print(f"generated {src} in {time.monotonic() - t:.0f}s", file=sys.stderr)
    if args.hub:
        bench_hub.source_hashes(src)  # while the new shards are still in the page cache
    shards = sorted(src.glob("*.safetensors"))
    source_bytes = sum(p.stat().st_size for p in shards)
    report: dict = {"shape": args.shape, "source_bytes": source_bytes, "device": args.device, "cpus": os.cpu_count()}

    report["cold_cache"] = drop_caches()
    report["read"] = cold_read(shards)
    report["libraries"] = "warm" if args.warm_libraries else "cold"
    out = args.dir / "out-prequant"
    drop_caches(args.warm_libraries)
    env = _env()
    report["prequant"] = run_prequant(str(src), out, args)
    output_bytes = report["prequant"]["output_bytes"]
    if not args.keep:
        shutil.rmtree(out, ignore_errors=True)  # the disk is small: its hashes are what later runs compare
    if args.also_device:  # the same checkpoint on another device (--device cpu beside cuda): same bytes too
        drop_caches(args.warm_libraries)
        also = run_prequant(str(src), args.dir / "out-also", argparse.Namespace(**{**vars(args), "device": args.also_device}))
        also["device"] = args.also_device
        also["same_bytes"] = also["weight_sha256"] == report["prequant"]["weight_sha256"]
        report["prequant_also"] = also
        shutil.rmtree(args.dir / "out-also", ignore_errors=True)
    if args.memory_limit_gib:  # the same conversion with torch capped: it must fit, to the same bytes
        drop_caches(args.warm_libraries)
        limited = run_prequant(str(src), args.dir / "out-limited", args,
                               {CUDA_MEMORY_LIMIT_ENV: f"{args.memory_limit_gib:g}GiB"})
        limited["memory_limit_bytes"] = int(args.memory_limit_gib * 2**30)
        limited["same_bytes"] = limited["weight_sha256"] == report["prequant"]["weight_sha256"]
        report["prequant_limited"] = limited
        shutil.rmtree(args.dir / "out-limited", ignore_errors=True)
    report["read_write"] = read_write_floor(shards, output_bytes, args.dir)
    if args.hub:
        report["hub"] = bench_hub.hub_path(src, args, report, drop_caches, run_prequant)
    if args.transformers:
        ref = args.dir / "out-transformers"
        shutil.rmtree(ref, ignore_errors=True)
        drop_caches(args.warm_libraries)
        r = timed([sys.executable, "-c", TRANSFORMERS_PATH, str(src), str(ref)], env=env)
        r.update(json.loads(r.pop("stdout").strip().splitlines()[-1]))
        r["output_bytes"] = sum(p.stat().st_size for p in ref.glob("*.safetensors"))
        report["transformers"] = r
        if not args.keep:
            shutil.rmtree(ref, ignore_errors=True)
    for key in PATHS:
        if key in report:
            report[key].pop("stdout", None)
            report[key]["ratio_to_read"] = round(report[key]["seconds"] / report["read"]["seconds"], 3)
            # Against the floor: what the converter adds beyond the disk's own cost of reading and durably writing.
            report[key]["ratio_to_floor"] = round(report[key]["seconds"] / report["read_write"]["seconds"], 3)
    print_table(report)
    text = json.dumps(report, indent=2)
    if args.json:
        args.json.write_text(text)
    else:
        print(text)


def cold_read(shards: list[Path]) -> dict:
    """`cat` of every shard to /dev/null (the caller drops the page cache first): how fast the disk gives the source."""
    return timed(["sh", "-c", 'cat "$@" > /dev/null', "cat", *map(str, shards)])


def read_write_floor(shards: list[Path], output_bytes: int, work: Path) -> dict:
    """The disk's own floor for any converter, from a cold page cache: read the source while durably writing as
    many bytes as the output (dd, fsync'd, into a scratch file under `work`)."""
    drop_caches()
    scratch = work / "write-floor.bin"
    script = 'dd if=/dev/zero of="$1" bs=64M count="$2" conv=fsync status=none & shift 2; cat "$@" > /dev/null; wait'
    try:
        return timed(["sh", "-c", script, "sh", str(scratch), str(-(-output_bytes // 2**26)), *map(str, shards)])
    finally:
        scratch.unlink(missing_ok=True)


def read_trace(path: Path, spawned: float) -> dict:
    """prequant's own timeline (PREQUANT_TRACE): events as seconds since the process was spawned, stage busy time."""
    try:
        t = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {"events": {name: round(at - spawned, 2) for name, at in t["events"]}, "busy": t["busy"]}


def print_table(r: dict) -> None:
    gib = 2**30
    print(f"\nsource: {r['source_bytes'] / 1e9:.1f} GB {r['shape']}, device {r['device']}, "
          f"{'cold' if r['cold_cache'] else 'WARM (could not drop caches)'} page cache, "
          f"{r.get('libraries', 'cold')} libraries", file=sys.stderr)
    print(f"{'path':16} {'wall s':>8} {'x read':>7} {'x floor':>8} {'RssAnon GiB':>12} {'VmRSS GiB':>10} "
          f"{'torch GiB':>10} {'NVML GiB':>9} {'out GB':>7}", file=sys.stderr)
    for key in PATHS:
        if key not in r:
            continue
        m = r[key]
        gpu, own = m.get("peak_gpu_bytes"), m.get("peak_gpu_process_bytes")
        print(f"{key:16} {m['seconds']:8.1f} {m['ratio_to_read']:7.2f} {m['ratio_to_floor']:8.2f} "
              f"{m['peak_rss_anon'] / gib:12.2f} {m['peak_vm_rss'] / gib:10.2f} {gpu / gib if gpu else float('nan'):10.2f} "
              f"{own / gib if own else float('nan'):9.2f} {m.get('output_bytes', 0) / 1e9:7.2f}", file=sys.stderr)
    if "prequant_also" in r:
        print(f"prequant_also: --device {r['prequant_also']['device']}, same bytes as --device {r['device']}: "
              f"{r['prequant_also']['same_bytes']}", file=sys.stderr)
    if "prequant_limited" in r:
        m = r["prequant_limited"]
        print(f"with torch capped at {m['memory_limit_bytes'] / gib:g} GiB: same bytes as uncapped: {m['same_bytes']}",
              file=sys.stderr)
    if "hub" in r:
        bench_hub.print_hub(r["hub"])
    trace = r.get("prequant", {}).get("trace")
    if trace:
        print("prequant timeline (s since spawn): " + ", ".join(f"{k} {v}" for k, v in trace["events"].items()),
              file=sys.stderr)
        print("prequant busy (s): " + ", ".join(f"{k} {v}" for k, v in trace["busy"].items()), file=sys.stderr)


if __name__ == "__main__":
    main()
