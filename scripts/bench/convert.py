"""Benchmark: prequant convert against a cold read of the source and against transformers' path.

Generates a synthetic checkpoint of about --size-gb GB (Llama-8B-, Grok-1- or uniform 32 MiB-tensor
shapes, random bf16; synthetic.py), then in one run measures, each from cold page cache where permitted:

  read              cat every shard to /dev/null (how fast the disk gives us the source)
  read_write        the same cat while dd writes as many bytes as prequant's output and fsyncs them: the disk's
                    floor for any converter that reads the source and writes its result durably
  prequant          python -m prequant convert SRC OUT --device D (the whole process, start-up included), with
                    its own timeline (PREQUANT_TRACE: start-up, planning, pipeline, hashing; busy time per stage)
  prequant_also     --also-device D2: the same on another device (e.g. cpu), and whether its bytes are equal
  prequant_limited  --memory-limit-gib G: the same with torch capped at G GiB of GPU memory
                    (PREQUANT_CUDA_MEMORY_LIMIT, i.e. torch.cuda.set_per_process_memory_fraction), same bytes?
  hub               --hub: from the local Hub server with --delete-source-shards (hub_path.py)
  transformers      from_pretrained(SRC, quantization_config=BitsAndBytesConfig(...)) + save_pretrained

and reports wall time, peak RssAnon / VmRSS (of the process and its children, sampled from /proc every 20 ms),
GPU memory (torch's peak reserved, and the process tree's own from NVML per process, common.py),
output size and each time's ratio to the cold read and to the read_write floor, as a table (stderr) and JSON
(stdout or --json FILE). Bytes are compared through the sha256 of the weight files in each prequant.json.

    python scripts/bench/convert.py --size-gb 16 --shape llama --device cuda --transformers
    python scripts/bench/convert.py --size-gb 16 --shape llama --device cuda --also-device cpu --warm-libraries
    python scripts/bench/convert.py --size-gb 33 --shape grok --device cuda --memory-limit-gib 8 --hub
    python scripts/bench/convert.py --size-gb 1 --shape uniform --device cpu
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

import hub_path  # this directory
from common import cold_read, drop_caches, emit, read_write_floor, run_env, run_prequant, timed
from synthetic import generated, source_arguments

# What prequant's quantizer reads (prequant/bnb/quantize.py); spelled here so the bench runs without importing torch.
CUDA_MEMORY_LIMIT_ENV = "PREQUANT_CUDA_MEMORY_LIMIT"
PATHS = ("read", "read_write", "prequant", "prequant_also", "prequant_limited", "transformers")  # table rows

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
    source_arguments(ap)
    ap.add_argument("--device", default="cuda")
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
                         "--delete-source-shards, against download alone and the local conversion (hub_path.py)")
    ap.add_argument("--keep", action="store_true", help="keep the generated checkpoint and outputs")
    ap.add_argument("--json", type=Path, help="write the JSON report here (default: stdout)")
    args = ap.parse_args()

    src = generated(args.shape, args.size_gb, args.dir, args.layers, args.dims)
    if args.hub:
        hub_path.source_hashes(src)  # while the new shards are still in the page cache
    shards = sorted(src.glob("*.safetensors"))
    source_bytes = sum(p.stat().st_size for p in shards)
    report: dict = {"shape": args.shape, "source_bytes": source_bytes, "device": args.device, "cpus": os.cpu_count()}

    def convert(name: str, device: str = args.device, extra_env: dict | None = None) -> dict:
        """One conversion from a cold page cache, its output removed once hashed unless --keep (the disk is
        small: its hashes are what later runs compare)."""
        drop_caches(args.warm_libraries)
        out = args.dir / f"out-{name}"
        r = run_prequant(str(src), out, device, args.dir, args.prequant_arg, extra_env)
        if not args.keep:
            shutil.rmtree(out, ignore_errors=True)
        return r

    report["cold_cache"] = drop_caches()
    report["read"] = cold_read(shards)
    report["libraries"] = "warm" if args.warm_libraries else "cold"
    report["prequant"] = convert("prequant")
    hashes = report["prequant"]["weight_sha256"]
    if args.also_device:  # the same checkpoint on another device (--device cpu beside cuda): same bytes too
        also = convert("also", args.also_device)
        also["device"] = args.also_device
        also["same_bytes"] = also["weight_sha256"] == hashes
        report["prequant_also"] = also
    if args.memory_limit_gib:  # the same conversion with torch capped: it must fit, to the same bytes
        limited = convert("limited", extra_env={CUDA_MEMORY_LIMIT_ENV: f"{args.memory_limit_gib:g}GiB"})
        limited["memory_limit_bytes"] = int(args.memory_limit_gib * 2**30)
        limited["same_bytes"] = limited["weight_sha256"] == hashes
        report["prequant_limited"] = limited
    report["read_write"] = read_write_floor(shards, report["prequant"]["output_bytes"], args.dir)
    if args.hub:
        report["hub"] = hub_path.measure(src, args, report)
    if args.transformers:
        ref = args.dir / "out-transformers"
        shutil.rmtree(ref, ignore_errors=True)
        drop_caches(args.warm_libraries)
        r = timed([sys.executable, "-c", TRANSFORMERS_PATH, str(src), str(ref)], env=run_env())
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
    emit(report, args.json, indent=2)


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
        hub_path.print_report(r["hub"])
    trace = r.get("prequant", {}).get("trace")
    if trace:
        print("prequant timeline (s since spawn): " + ", ".join(f"{k} {v}" for k, v in trace["events"].items()),
              file=sys.stderr)
        print("prequant busy (s): " + ", ".join(f"{k} {v}" for k, v in trace["busy"].items()), file=sys.stderr)


if __name__ == "__main__":
    main()
