"""Benchmark: the training step of MoE QLoRA with LoRA on attention and every expert (`load_for_fsdp` of a
`--quantize-experts` checkpoint), with the mechanism that gives every rank a gradient for every LoRA parameter and
without it.

  mechanism  `bnb.moe.PerExpert` as it runs: every expert, an idle one on zero rows (an empty input: no
             dequantization, a zero gradient for its LoRA)
  baseline   the loop over the experts the router chose only (transformers' eager loop), which leaves an idle expert's
             LoRA without a gradient: FSDP's reduce-scatter then differs between ranks whose routing differs, so the
             baseline runs only where no rank disagrees

On one rank (torchrun, NCCL on a GPU; gloo on the CPU) no rank can disagree, so the difference is the mechanism's
cost. With --nproc 2 every rank gets the same batch, so that the baseline survives. Each --tokens count is timed:
a batch long enough to reach every expert, and a short one that leaves experts idle. The two modes alternate, step
by step after a warm-up step each; the report gives each mode's median step time, the ratio, the idle experts per
MoE layer and step, and peak GPU memory in the steps, as JSON (stdout or --json) and a table (stderr).

    torch: python scripts/bench/moe_step.py CHECKPOINT --tokens 4096 --tokens 64 --steps 6 --json moe-step.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", type=Path, help="prequant's output with 4-bit experts (--quantize-experts)")
    ap.add_argument("--tokens", type=int, action="append", help="tokens per step (repeat; default 4096 and 64)")
    ap.add_argument("--seq-len", type=int, default=1024, help="the longest sequence; more tokens make more rows")
    ap.add_argument("--steps", type=int, default=6, help="timed steps per mode and token count")
    ap.add_argument("--lora-r", type=int, default=16)
    ap.add_argument("--gradient-checkpointing", action="store_true")
    ap.add_argument("--nproc", type=int, default=1, help="ranks (every rank the same batch)")
    ap.add_argument("--json", type=Path, help="write the JSON report here (default: stdout)")
    ap.add_argument("--job", action="store_true", help=argparse.SUPPRESS)  # a rank's process
    args = ap.parse_args()
    args.tokens = args.tokens or [4096, 64]
    if args.job:
        job(args)
        return
    report = args.json or Path(os.environ.get("TMPDIR", "/tmp")) / f"moe-step-{os.getpid()}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}", __file__,
           str(args.checkpoint), "--job", "--json", str(report), "--steps", str(args.steps), "--seq-len",
           str(args.seq_len), "--lora-r", str(args.lora_r), *[a for t in args.tokens for a in ("--tokens", str(t))],
           *(["--gradient-checkpointing"] if args.gradient_checkpointing else [])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    subprocess.run(cmd, check=True, env=env)
    result = json.loads(report.read_text())
    for row in result["rows"]:
        print(f"{row['tokens']:>6} tokens  mechanism {row['mechanism_s'] * 1e3:8.1f} ms  baseline "
              f"{row['baseline_s'] * 1e3:8.1f} ms  x{row['ratio']:.3f}  idle experts per layer {row['idle_per_layer']}"
              f"  peak GPU {row['peak_gib']:.1f} GiB", file=sys.stderr)
    if args.json is None:
        print(json.dumps(result, indent=1))


def hit_only_forward(self, hidden_states, top_k_index, top_k_weights):
    """The baseline: `PerExpert.forward` over the experts the router chose alone."""
    import torch

    final = torch.zeros_like(hidden_states)
    mask, hit = self.routed(top_k_index)
    for index in sorted(hit):
        top_k_pos, token_idx = torch.where(mask[index])
        self.add_expert(final, index, hidden_states, token_idx, top_k_pos, top_k_weights)
    return final


def job(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import prequant
    from prequant.bnb.moe import PerExpert

    model = prequant.load_for_fsdp(args.checkpoint, lora_r=args.lora_r, lora_alpha=2 * args.lora_r,
                                   gradient_checkpointing=args.gradient_checkpointing)
    device = next(p.device for p in model.parameters())
    cuda = device.type == "cuda"
    layers = [m for m in model.modules() if isinstance(m, PerExpert)]
    if not layers:
        raise SystemExit(f"{args.checkpoint}: no 4-bit experts (convert it with --quantize-experts)")
    idle: list[int] = []
    for layer in layers:
        layer.register_forward_pre_hook(
            lambda m, a: idle.append(m.num_experts - len(set(a[1].flatten().tolist()) - {m.num_experts})))
    lora = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(lora, lr=1e-5)
    vocab = model.config.vocab_size
    mechanism = PerExpert.forward

    def step(ids: torch.Tensor) -> float:
        if cuda:
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize(device)
        return time.perf_counter() - t

    rows = []
    for tokens in args.tokens:
        seq = min(tokens, args.seq_len)
        ids = torch.randint(0, vocab, (max(1, tokens // seq), seq), generator=torch.Generator().manual_seed(tokens))
        ids = ids.to(device)
        times: dict[str, list[float]] = {"mechanism": [], "baseline": []}
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        for i in range(args.steps + 1):
            for mode in ("mechanism", "baseline") if i % 2 == 0 else ("baseline", "mechanism"):
                PerExpert.forward = mechanism if mode == "mechanism" else hit_only_forward
                idle.clear()
                elapsed = step(ids)
                if i:  # the first step of each mode warms up
                    times[mode].append(elapsed)
        PerExpert.forward = mechanism
        median = {mode: statistics.median(t) for mode, t in times.items()}
        rows.append({"tokens": int(ids.numel()), "mechanism_s": median["mechanism"], "baseline_s": median["baseline"],
                     "ratio": median["mechanism"] / median["baseline"], "times": times,
                     "idle_per_layer": round(sum(idle) / max(1, len(idle)), 2),
                     "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else 0.0})
    if dist.get_rank() == 0:
        result = {"checkpoint": str(args.checkpoint), "device": torch.cuda.get_device_name(device) if cuda else "cpu",
                  "torch": torch.__version__, "ranks": dist.get_world_size(), "moe_layers": len(layers),
                  "experts": layers[0].num_experts, "lora_r": args.lora_r, "lora_params": sum(p.numel() for p in lora),
                  "gradient_checkpointing": args.gradient_checkpointing, "rows": rows}
        args.json.write_text(json.dumps(result, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
