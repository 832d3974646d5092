"""Benchmark: GPU memory of QLoRA on an MoE model, prequant's `load_for_fsdp` of a `--quantize-experts` checkpoint
against transformers 5's own quantize-on-load of the same bf16 source.

  prequant      `load_for_fsdp(CHECKPOINT)` on one rank (torchrun, NCCL; gloo without CUDA), every expert 4-bit, LoRA on
                attention and on every expert's projections (--targets), then one training step
  transformers  `from_pretrained(SOURCE, quantization_config=BitsAndBytesConfig(load_in_4bit=True, nf4, double quant,
                bf16 compute and storage), device_map=DEVICE)`, which quantizes the attention's Linear layers and leaves
                the fused 3-D experts 16-bit, peft LoRA on attention (--attention), then one training step

Each runs in its own process (one training step on a fixed random batch: AdamW, bf16 autocast) and reports torch's
peak allocated and reserved GPU memory while loading and during the step, and the process's peak resident memory
(VmHWM), as JSON (stdout or --json FILE) and a table (stderr). Without CUDA both run on the CPU and report no GPU
figure (smoke runs).

    python scripts/bench/moe_memory.py --checkpoint OUT-4BIT --source SRC-BF16 --json moe-memory.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from common import emit, run_env, status_bytes

GIB = 2**30
MIXTRAL = "q_proj,k_proj,v_proj,o_proj,w1,w2,w3"  # attention and every expert's projections (Mixtral's names)
ATTENTION = "q_proj,k_proj,v_proj,o_proj"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", type=Path, help="prequant's output with 4-bit experts (--quantize-experts)")
    ap.add_argument("--source", type=Path, help="the bf16 source it was converted from")
    ap.add_argument("--targets", default=MIXTRAL, help=f"prequant's LoRA targets (default {MIXTRAL})")
    ap.add_argument("--attention", default=ATTENTION, help=f"transformers' LoRA targets (default {ATTENTION})")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--lora-r", type=int, default=16)
    ap.add_argument("--timeout", type=float, default=400, help="seconds allowed per loader")
    ap.add_argument("--json", type=Path, help="write the JSON report here (default: stdout)")
    ap.add_argument("--job", choices=("prequant", "transformers"), help=argparse.SUPPRESS)  # one loader's process
    ap.add_argument("--report", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.job:
        job(args)
        return
    report: dict = {"checkpoint": str(args.checkpoint), "source": str(args.source), "seq_len": args.seq_len,
                    "batch_size": args.batch_size, "lora_r": args.lora_r}
    shared = ["--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size), "--lora-r", str(args.lora_r),
              "--targets", args.targets, "--attention", args.attention]
    for loader, launch in (("prequant", [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                         "--nproc_per_node=1"]),
                           ("transformers", [sys.executable])):
        if (args.checkpoint if loader == "prequant" else args.source) is None:
            continue
        out = Path(f"/tmp/moe-memory-{os.getpid()}-{loader}.json")
        cmd = [*launch, __file__, "--job", loader, "--report", str(out), *shared,
               "--checkpoint", str(args.checkpoint), "--source", str(args.source)]
        print(f"moe_memory: {loader}", file=sys.stderr, flush=True)
        try:
            done = subprocess.run(cmd, env=run_env(PYTHONUNBUFFERED="1"), timeout=args.timeout, check=False)
            error = f"exit status {done.returncode}" if done.returncode else None
        except subprocess.TimeoutExpired:
            error = f"timed out after {args.timeout:.0f} s"
        report[loader] = json.loads(out.read_text()) if out.is_file() else {}
        if error:
            report[loader]["error"] = error
        out.unlink(missing_ok=True)
    print_table(report)
    emit(report, args.json, indent=2)


def job(args: argparse.Namespace) -> None:
    """One loader in this process: load, then one training step; peaks of each phase to --report."""
    import torch

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    import bitsandbytes  # imported before the clock: the load phase measures loading
    import peft  # noqa: F401
    import transformers  # noqa: F401

    t0 = time.monotonic()
    model = load_prequant(args, device) if args.job == "prequant" else load_transformers(args, device)
    load = {"seconds": round(time.monotonic() - t0, 1), **peaks(device)}
    vocab = model.config.get_text_config().vocab_size
    batch = torch.randint(0, vocab, (args.batch_size, args.seq_len), generator=torch.Generator().manual_seed(0))
    batch = batch.to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    t0 = time.monotonic()
    with torch.autocast(device.type, dtype=torch.bfloat16):
        loss = model(input_ids=batch, labels=batch).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    step = {"seconds": round(time.monotonic() - t0, 1), "loss": loss.item(), **peaks(device)}
    lora = sum(p.numel() for p in params)
    four_bit = sum(1 for m in model.modules() if isinstance(m, bitsandbytes.nn.Linear4bit))  # not peft's wrappers
    report = {"device": str(device), "load": load, "step": step, "lora_parameters": lora,
              "lora_modules": len({n.rsplit(".lora_", 1)[0] for n, p in model.named_parameters() if p.requires_grad}),
              "linear4bit_modules": four_bit, "peak_vm_hwm": (status_bytes("self", ("VmHWM",)) or {}).get("VmHWM"),
              "gpu_name": torch.cuda.get_device_name(device) if cuda else None}
    if args.job == "prequant":
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()
    args.report.write_text(json.dumps(report, indent=2))


def load_prequant(args: argparse.Namespace, device):
    from prequant.fsdp import load_for_fsdp

    return load_for_fsdp(args.checkpoint, lora_r=args.lora_r, lora_alpha=2 * args.lora_r, device=device,
                         target_modules=args.targets.split(","))


def load_transformers(args: argparse.Namespace, device):
    import torch
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from prequant.fsdp import lora_config

    cfg = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                             bnb_4bit_compute_dtype=torch.bfloat16, bnb_4bit_quant_storage=torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(args.source, quantization_config=cfg, device_map=str(device),
                                                 dtype=torch.bfloat16)
    model.config.use_cache = False
    model = get_peft_model(model, lora_config(args.lora_r, 2 * args.lora_r, 0.0, args.attention.split(",")))
    model.train()
    return model


def peaks(device) -> dict:
    """torch's peak allocated and reserved GPU bytes since the last call (then reset); None off CUDA."""
    import torch

    if device.type != "cuda":
        return {"peak_gpu_allocated": None, "peak_gpu_reserved": None}
    torch.cuda.synchronize(device)
    out = {"peak_gpu_allocated": torch.cuda.max_memory_allocated(device),
           "peak_gpu_reserved": torch.cuda.max_memory_reserved(device)}
    torch.cuda.reset_peak_memory_stats(device)
    return out


def print_table(r: dict) -> None:
    def gib(v) -> str:
        return f"{v / GIB:9.2f}" if v is not None else f"{'-':>9}"

    print(f"\n{'loader':14} {'load GiB':>9} {'step GiB':>9} {'load res':>9} {'step res':>9} {'load s':>7} "
          f"{'VmHWM':>8} {'4-bit':>6} {'LoRA mods':>9}  (torch's peak allocated / reserved)", file=sys.stderr)
    for loader in ("prequant", "transformers"):
        m = r.get(loader)
        if not m or "load" not in m:
            print(f"{loader:14} {m.get('error', 'not run') if m is not None else 'not run'}", file=sys.stderr)
            continue
        print(f"{loader:14} {gib(m['load']['peak_gpu_allocated'])} {gib(m['step']['peak_gpu_allocated'])} "
              f"{gib(m['load']['peak_gpu_reserved'])} {gib(m['step']['peak_gpu_reserved'])} "
              f"{m['load']['seconds']:7.1f} {gib(m['peak_vm_hwm'])[1:]} {m['linear4bit_modules']:6d} "
              f"{m['lora_modules']:9d}", file=sys.stderr)


if __name__ == "__main__":
    main()
