"""Benchmark: prequant merge of a LoRA adapter into a synthetic base, against the disk's floor.

Generates a synthetic checkpoint of about --size-gb GB or --layers layers (synthetic.py) and a random rank --rank
adapter on every linear layer of it (adapter_model.safetensors + adapter_config.json, as peft saves one), converts
the base to 4-bit (for merge4), then measures, each from a cold page cache where permitted (--bases picks them):

  merge16        python -m prequant merge ADAPTER OUT --base BASE: into the 16-bit base, 16-bit out
  merge4         the same into the base's 4-bit conversion (its weights dequantized), 16-bit out
  floor16/4      the disk's floor for each: read the base's shards and the adapter while dd durably writes as many
                 bytes as the merge wrote (common.read_write_floor), into the room of the merge's output, deleted
                 first (the disk then holds the base and one output's worth at a time)
  agreement      --agreement: every (B @ A) * scaling in float32 on the GPU and on the CPU, and the merged bf16 weights
                 from each: how many elements differ (TF32 off)

and reports wall time, its ratio to the floor, peak host memory (RssAnon / VmRSS of the process tree), GPU memory and
bytes written, as JSON (stdout or --json FILE).

    python scripts/bench/merge.py --size-gb 16 --shape llama --device cuda --rank 64 --agreement
    python scripts/bench/merge.py --size-gb 0.05 --shape uniform --device cpu --rank 4
    python scripts/bench/merge.py --layers 56 --shape llama --device cuda --rank 64 --bases 16   # 27.5 GB
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

from common import drop_caches, emit, read_trace, read_write_floor, run_env, run_prequant, timed
from synthetic import generated, source_arguments

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TARGETS_WEIGHT = tuple(f"{t}.weight" for t in TARGETS)


def make_adapter(base: Path, out: Path, rank: int) -> None:
    """A random LoRA adapter (float32, B non-zero) on every linear layer of `base`, written one layer at a time."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    index = json.loads((base / "model.safetensors.index.json").read_text())["weight_map"]
    shapes: dict[str, tuple[int, ...]] = {}
    for name in sorted(set(index.values())):
        with safe_open(base / name, "pt") as f:
            found = [k for k in f.keys() if k.endswith(TARGETS_WEIGHT)]  # noqa: SIM118 - a safe_open, no dict
            shapes.update({k: tuple(f.get_slice(k).get_shape()) for k in found})
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device).manual_seed(0)
    tensors = {}
    for key, (rows, cols) in sorted(shapes.items()):
        module = "base_model.model." + key.removesuffix(".weight")
        tensors[f"{module}.lora_A.weight"] = (torch.randn(rank, cols, generator=gen, device=device) / cols**0.5).cpu()
        tensors[f"{module}.lora_B.weight"] = (torch.randn(rows, rank, generator=gen, device=device) * 1e-3).cpu()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "adapter_model.safetensors", metadata={"format": "pt"})
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS),
              "base_model_name_or_path": str(base), "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
              "task_type": "CAUSAL_LM", "bias": "none", "rank_pattern": {}, "alpha_pattern": {}}
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))


def agreement(base: Path, adapter: Path, seconds: float = 120.0) -> dict:
    """Every target's delta in float32 on the GPU and on the CPU, and the bf16 merged weight from each: elements
    that differ (of all), and the largest difference in float32 units of the last place. Stops after `seconds`
    (the targets compared are counted: `tensors` of `targets`)."""
    import torch
    from safetensors import safe_open

    torch.backends.cuda.matmul.allow_tf32 = False
    config = json.loads((adapter / "adapter_config.json").read_text())
    scaling = config["lora_alpha"] / config["r"]
    index = json.loads((base / "model.safetensors.index.json").read_text())["weight_map"]
    counts = {"elements": 0, "delta_differ": 0, "merged_differ": 0, "tensors_with_merged_difference": 0,
              "tensors": 0, "targets": sum(k.endswith(TARGETS_WEIGHT) for k in index)}
    stop = time.monotonic() + seconds
    with safe_open(adapter / "adapter_model.safetensors", "pt") as lora:
        for key in sorted(k for k in index if k.endswith(TARGETS_WEIGHT)):
            if time.monotonic() > stop:
                break
            counts["tensors"] += 1
            module = "base_model.model." + key.removesuffix(".weight")
            a, b = lora.get_tensor(f"{module}.lora_A.weight"), lora.get_tensor(f"{module}.lora_B.weight")
            with safe_open(base / index[key], "pt") as f:
                w = f.get_tensor(key)
            cpu = (b @ a).mul_(scaling)
            gpu = (b.cuda() @ a.cuda()).mul_(scaling).cpu()
            merged_cpu, merged_gpu = cpu.add(w.float()).to(w.dtype), gpu.add(w.float()).to(w.dtype)
            counts["elements"] += w.numel()
            counts["delta_differ"] += int((cpu != gpu).sum())
            differ = int((merged_cpu.view(torch.int16) != merged_gpu.view(torch.int16)).sum())
            counts["merged_differ"] += differ
            counts["tensors_with_merged_difference"] += differ > 0
    counts["merged_differ_fraction"] = counts["merged_differ"] / max(1, counts["elements"])
    return counts


def run_merge(adapter: Path, base: Path, out: Path, device: str, work: Path) -> dict:
    """`python -m prequant merge ADAPTER OUT --base BASE --device DEVICE --json` as a whole process, from a cold
    page cache: wall, memory, GPU memory, bytes written, its trace."""
    shutil.rmtree(out, ignore_errors=True)
    drop_caches(warm_libraries=True)
    trace_file = work / "prequant-trace.json"
    trace_file.unlink(missing_ok=True)
    spawned = time.time()
    r = timed([sys.executable, "-m", "prequant", "merge", str(adapter), str(out), "--base", str(base),
               "--device", device, "--json"], env=run_env(PREQUANT_TRACE=str(trace_file)), gpu=device != "cpu")
    r["trace"] = read_trace(trace_file, spawned)
    summary = json.loads(r.pop("stdout"))
    r["peak_gpu_bytes"] = summary.get("peak_gpu_bytes")
    r["output_bytes"] = summary["output_bytes"]
    r["input_bytes"] = summary["input_bytes"]
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source_arguments(ap)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--agreement", action="store_true", help="compare float32 products on the GPU and the CPU")
    ap.add_argument("--bases", default="16,4", help="which merges: 16 (into the bf16 base), 4 (into its NF4 "
                    "conversion) or both, comma-separated")
    ap.add_argument("--keep", action="store_true", help="keep the generated checkpoints and outputs")
    ap.add_argument("--json", type=Path, help="write the JSON report here (default: stdout)")
    args = ap.parse_args()

    base = generated(args.shape, args.size_gb, args.dir, layers=args.layers, dims=args.dims)
    adapter = args.dir / f"adapter-{base.name}-r{args.rank}"
    if not (adapter / "adapter_config.json").exists():
        t = time.monotonic()
        subprocess.run([sys.executable, __file__, "--make-adapter", str(base), str(adapter), str(args.rank)],
                       check=True, env=run_env())
        print(f"generated {adapter} in {time.monotonic() - t:.0f}s", file=sys.stderr)
    adapter_file = adapter / "adapter_model.safetensors"
    report: dict = {"shape": args.shape, "device": args.device, "rank": args.rank, "cpus": os.cpu_count(),
                    "cold_cache": drop_caches(), "adapter_bytes": adapter_file.stat().st_size}
    bases = args.bases.split(",")
    four = args.dir / "base-nf4"
    if "4" in bases:
        report["convert"] = run_prequant(str(base), four, args.device, args.dir)
        report["convert"].pop("weight_sha256", None)
    for name, source in (("merge16", base), ("merge4", four)):
        if name.removeprefix("merge") not in bases:
            continue
        out = args.dir / f"out-{name}"
        r = run_merge(adapter, source, out, args.device, args.dir)
        shards = [*sorted(source.glob("*.safetensors")), adapter_file]
        r["source_bytes"] = sum(p.stat().st_size for p in shards)
        if not args.keep:  # the floor's scratch file takes its place on the disk
            shutil.rmtree(out, ignore_errors=True)
        floor = read_write_floor(shards, r["output_bytes"], args.dir)
        r["floor_seconds"] = floor["seconds"]
        r["ratio_to_floor"] = round(r["seconds"] / floor["seconds"], 3)
        report[name] = r
        print(f"{name}: {r['seconds']:.1f} s, floor {r['floor_seconds']:.1f} s (x{r['ratio_to_floor']}), "
              f"{r['output_bytes'] / 1e9:.2f} GB written, peak RssAnon {r['peak_rss_anon'] / 2**30:.2f} GiB",
              file=sys.stderr)
        if args.json:  # what is measured so far, should the rest run out of time
            emit(report, args.json)
    if not args.keep:
        shutil.rmtree(four, ignore_errors=True)
    if args.agreement:
        report["agreement"] = json.loads(subprocess.run(
            [sys.executable, __file__, "--agreement-of", str(base), str(adapter)], check=True, capture_output=True,
            text=True, env=run_env()).stdout)
        print(f"agreement: {report['agreement']}", file=sys.stderr)
    emit(report, args.json)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--make-adapter"]:
        make_adapter(Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4]))
    elif sys.argv[1:2] == ["--agreement-of"]:
        print(json.dumps(agreement(Path(sys.argv[2]), Path(sys.argv[3]))))
    else:
        main()
