"""Benchmark: prequant convert against a cold read of the source and against transformers' path.

Generates a synthetic checkpoint of about --size-gb GB (Llama-8B-, Grok-1- or uniform 32 MiB-tensor
shapes, random bf16), then in one run measures, each from cold page cache where permitted:

  read          cat every shard to /dev/null (how fast the disk gives us the source)
  read_write    the same cat while dd writes as many bytes as prequant's output and fsyncs them: the disk's
                floor for any converter that reads the source and writes its result durably
  prequant      python -m prequant convert SRC OUT --device D (the whole process, start-up included), with
                its own timeline (PREQUANT_TRACE: start-up, planning, pipeline, hashing; busy time per stage)
  transformers  from_pretrained(SRC, quantization_config=BitsAndBytesConfig(...)) + save_pretrained

and reports wall time, peak RssAnon / VmRSS (of the process and its children, sampled from /proc every 20 ms),
peak GPU memory, output size and each time's ratio to the cold read and to the read_write floor, as a table
(stderr) and JSON (stdout or --json FILE).

    python scripts/bench.py --size-gb 16 --shape llama --device cuda --transformers
    python scripts/bench.py --size-gb 1 --shape uniform --device cpu
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SHAPES = {
    # name: model dimensions; layer_tensors() and config_for() turn them into tensors and a config.json
    "llama": dict(hidden=4096, inter=14336, kv=1024, vocab=128256, heads=32, kv_heads=8),
    "grok": dict(hidden=6144, inter=32768, kv=1024, vocab=131072, heads=48, kv_heads=8, experts=8),
    "uniform": dict(hidden=4096, inter=4096, kv=4096, vocab=4096, heads=32, kv_heads=32),
}


def layer_tensors(shape: str, i: int) -> list[tuple[str, tuple[int, ...]]]:
    c = SHAPES[shape]
    h, f, kv = c["hidden"], c["inter"], c["kv"]
    if shape == "grok":  # keyfan/grok-1-hf naming; quantized by prequant's name rules
        p = f"transformer.decoder_layer.{i}"
        out = [(f"{p}.multi_head_attention.{n}.weight", s) for n, s in
               (("query", (h, h)), ("key", (kv, h)), ("value", (kv, h)), ("linear", (h, h)))]
        out.append((f"{p}.router.weight", (c["experts"], h)))
        for e in range(c["experts"]):
            out += [(f"{p}.moe.{e}.linear.weight", (f, h)), (f"{p}.moe.{e}.linear_v.weight", (f, h)),
                    (f"{p}.moe.{e}.linear_1.weight", (h, f))]
        out += [(f"{p}.{n}.weight", (h,)) for n in ("rms_norm", "rms_norm_1", "rms_norm_2", "rms_norm_3")]
        return out
    p = f"model.layers.{i}"
    return [
        (f"{p}.self_attn.q_proj.weight", (h, h)), (f"{p}.self_attn.k_proj.weight", (kv, h)),
        (f"{p}.self_attn.v_proj.weight", (kv, h)), (f"{p}.self_attn.o_proj.weight", (h, h)),
        (f"{p}.mlp.gate_proj.weight", (f, h)), (f"{p}.mlp.up_proj.weight", (f, h)),
        (f"{p}.mlp.down_proj.weight", (h, f)),
        (f"{p}.input_layernorm.weight", (h,)), (f"{p}.post_attention_layernorm.weight", (h,)),
    ]


def config_for(shape: str, layers: int) -> dict:
    c = SHAPES[shape]
    if shape == "grok":
        return {"architectures": ["Grok1ModelForCausalLM"], "model_type": "grok-1",
                "auto_map": {"AutoModelForCausalLM": "modeling_grok1.Grok1ModelForCausalLM"},
                "hidden_size": c["hidden"], "intermediate_size": c["inter"], "num_hidden_layers": layers,
                "num_attention_heads": c["heads"], "num_key_value_heads": c["kv_heads"], "vocab_size": c["vocab"],
                "num_experts": c["experts"], "num_experts_per_tok": 2, "torch_dtype": "bfloat16"}
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": c["hidden"],
            "intermediate_size": c["inter"], "num_hidden_layers": layers, "num_attention_heads": c["heads"],
            "num_key_value_heads": c["kv_heads"], "vocab_size": c["vocab"], "head_dim": c["hidden"] // c["heads"],
            "rms_norm_eps": 1e-5, "max_position_embeddings": 8192, "tie_word_embeddings": False,
            "torch_dtype": "bfloat16", "hidden_act": "silu"}


def generate(shape: str, size_gb: float, out: Path, shard_gb: float = 5.0) -> Path:
    """Write a random bf16 checkpoint of about size_gb, shard by shard (one shard in memory at a time)."""
    import torch
    from safetensors.torch import save_file

    c = SHAPES[shape]
    embed = [("model.embed_tokens.weight" if shape != "grok" else "transformer.in_out_embed.weight",
              (c["vocab"], c["hidden"]))]
    head = [("lm_head.weight", (c["vocab"], c["hidden"])),
            ("model.norm.weight" if shape != "grok" else "transformer.rms_norm.weight", (c["hidden"],))]
    per_layer = sum(2 * math.prod(s) for _, s in layer_tensors(shape, 0))
    fixed = sum(2 * math.prod(s) for _, s in embed + head)
    layers = max(1, round((size_gb * 1e9 - fixed) / per_layer))
    tensors = embed + [t for i in range(layers) for t in layer_tensors(shape, i)] + head
    out.mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    used = 0
    for name, s in tensors:
        nbytes = 2 * math.prod(s)
        if used and used + nbytes > shard_gb * 1e9:
            shards.append([])
            used = 0
        shards[-1].append((name, s))
        used += nbytes
    weight_map, gen = {}, torch.Generator(device).manual_seed(0)
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        data = {n: (torch.randn(s, generator=gen, device=device, dtype=torch.float32) * 0.02).to(torch.bfloat16).cpu()
                for n, s in shard}
        save_file(data, out / fname, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(data, fname))
        del data
    total = sum(2 * math.prod(s) for _, s in tensors)
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (out / "config.json").write_text(json.dumps(config_for(shape, layers), indent=2))
    return out


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


class Sampler:
    """Samples the memory of a process and all its descendants (prequant's layout child included) from
    /proc every `interval` until the process exits; keeps the peaks of their sums."""

    FIELDS = ("RssAnon", "RssFile", "VmRSS")

    def __init__(self, pid: int, interval: float = 0.02) -> None:
        self.pid, self.interval = pid, interval
        self.peak = dict.fromkeys(self.FIELDS, 0)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while Path(f"/proc/{self.pid}").exists():
            total = dict.fromkeys(self.FIELDS, 0)
            for pid in _tree(self.pid):
                try:
                    text = Path(f"/proc/{pid}/status").read_text()
                except OSError:
                    continue  # exited meanwhile
                for line in text.splitlines():
                    key, _, value = line.partition(":")
                    if key in total:
                        total[key] += int(value.split()[0]) * 1024
            for key, value in total.items():
                self.peak[key] = max(self.peak[key], value)
            time.sleep(self.interval)

    def join(self) -> dict[str, int]:
        self._thread.join(timeout=1)
        return self.peak


def _tree(pid: int) -> list[int]:
    """`pid` and its descendants, from /proc/PID/task/*/children."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        for task in Path(f"/proc/{p}/task").glob("*/children"):
            try:
                todo += [int(c) for c in task.read_text().split()]
            except OSError:
                pass
    return found


def timed(cmd: list[str], env: dict | None = None) -> dict:
    """Run a command, sampling its memory; return wall time, peaks and its stdout."""
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    sampler = Sampler(proc.pid)
    stdout, stderr = proc.communicate()
    wall = time.monotonic() - start
    peaks = sampler.join()
    if proc.returncode != 0:
        raise SystemExit(f"{cmd[:4]} failed ({proc.returncode}):\n{stderr[-3000:]}")
    return {"seconds": round(wall, 2), "peak_rss_anon": peaks["RssAnon"], "peak_rss_file": peaks["RssFile"],
            "peak_vm_rss": peaks["VmRSS"], "stdout": stdout, "stderr_tail": stderr[-500:]}


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
    ap.add_argument("--keep", action="store_true", help="keep the generated checkpoint and outputs")
    ap.add_argument("--json", type=Path, help="write the JSON report here (default: stdout)")
    args = ap.parse_args()

    src = args.dir / f"{args.shape}-{args.size_gb:g}gb"
    if not (src / "config.json").exists():
        t = time.monotonic()
        generate(args.shape, args.size_gb, src)
        print(f"generated {src} in {time.monotonic() - t:.0f}s", file=sys.stderr)
    shards = sorted(src.glob("*.safetensors"))
    source_bytes = sum(p.stat().st_size for p in shards)
    report: dict = {"shape": args.shape, "source_bytes": source_bytes, "device": args.device, "cpus": os.cpu_count()}

    report["cold_cache"] = drop_caches()
    report["read"] = timed(["sh", "-c", 'cat "$@" > /dev/null', "cat", *map(str, shards)])
    report["libraries"] = "warm" if args.warm_libraries else "cold"
    out = args.dir / "out-prequant"
    shutil.rmtree(out, ignore_errors=True)
    drop_caches(args.warm_libraries)
    env = _env()
    trace_file = args.dir / "prequant-trace.json"
    spawned = time.time()
    report["prequant"] = timed([sys.executable, "-m", "prequant", "convert", str(src), str(out), "--device",
                                args.device, "--json", *args.prequant_arg], env={**env, "PREQUANT_TRACE": str(trace_file)})
    report["prequant"]["trace"] = read_trace(trace_file, spawned)
    summary = json.loads(report["prequant"].pop("stdout"))
    report["prequant"]["peak_gpu_bytes"] = summary.get("peak_gpu_bytes")
    report["prequant"]["output_bytes"] = summary["output_bytes"]
    # The disk's own floor for any converter: read the source while durably writing as many bytes as the output.
    drop_caches()
    scratch = args.dir / "write-floor.bin"
    report["read_write"] = timed(["sh", "-c", 'dd if=/dev/zero of="$1" bs=64M count="$2" conv=fsync status=none & '
                                  'shift 2; cat "$@" > /dev/null; wait', "sh", str(scratch),
                                  str(-(-summary["output_bytes"] // 2**26)), *map(str, shards)])
    scratch.unlink(missing_ok=True)
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
    if not args.keep:
        shutil.rmtree(out, ignore_errors=True)
    for key in ("read", "read_write", "prequant", "transformers"):
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
    print(f"{'path':13} {'wall s':>8} {'x read':>7} {'x floor':>8} {'RssAnon GiB':>12} {'VmRSS GiB':>10} {'GPU GiB':>8} "
          f"{'out GB':>7}", file=sys.stderr)
    for key in ("read", "read_write", "prequant", "transformers"):
        if key not in r:
            continue
        m = r[key]
        gpu = m.get("peak_gpu_bytes")
        print(f"{key:13} {m['seconds']:8.1f} {m['ratio_to_read']:7.2f} {m['ratio_to_floor']:8.2f} "
              f"{m['peak_rss_anon'] / gib:12.2f} {m['peak_vm_rss'] / gib:10.2f} {gpu / gib if gpu else float('nan'):8.2f} "
              f"{m.get('output_bytes', 0) / 1e9:7.2f}", file=sys.stderr)
    trace = r.get("prequant", {}).get("trace")
    if trace:
        print("prequant timeline (s since spawn): " + ", ".join(f"{k} {v}" for k, v in trace["events"].items()),
              file=sys.stderr)
        print("prequant busy (s): " + ", ".join(f"{k} {v}" for k, v in trace["busy"].items()), file=sys.stderr)


if __name__ == "__main__":
    main()
