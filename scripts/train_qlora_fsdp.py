"""Fine-tune a prequant 4-bit checkpoint with FSDP+QLoRA; every rank loads only its own shards.

    torchrun --nproc_per_node 2 scripts/train_qlora_fsdp.py ./llama3-8b-nf4 --data train.jsonl --steps 200 \\
        --output ./llama3-8b-lora

`prequant.load_for_fsdp` builds the model on the meta device, puts bitsandbytes 4-bit layers where the
checkpoint has packed weights, adds LoRA on all linear layers, shards it with FSDP2 and fills each rank's
shards straight from the memory-mapped safetensors. From there it is a plain PyTorch loop: only the LoRA
weights train (fp32 masters, bf16 compute), gradients are reduced in fp32.

--data is a JSONL file of conversations ({"messages": [...]}, rendered with the tokenizer's chat template) or texts
({"text": ...}), or any other file as plain text (default: the example conversations, scripts/data/chats.jsonl). It
is tokenized with the checkpoint's tokenizer and cut into --seq-len blocks; each rank takes every world-size-th
block. The adapter is saved in peft's format: `PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(ckpt),
output)` loads it on one GPU, unsharded.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from prequant.errors import PrequantError, UsageError
from prequant.fsdp import init_distributed, load_for_fsdp, missing_launcher_env

CHATS = Path(__file__).resolve().parent / "data" / "chats.jsonl"


def read_text(path: Path, tokenizer: Any) -> str:
    """The training text: a JSONL file's conversations (chat template) or texts (EOS appended), or the file as is."""
    if path.suffix != ".jsonl":
        return path.read_text()
    parts = []
    for line in path.read_text().splitlines():
        if line.strip():
            example = json.loads(line)
            parts.append(tokenizer.apply_chat_template(example["messages"], tokenize=False) if "messages" in example
                         else example["text"] + tokenizer.eos_token)
    return "".join(parts)


def batches(args: argparse.Namespace, rank: int, world: int) -> Iterator[torch.Tensor]:
    """Endless [batch, seq] blocks of token ids for this rank, in a seeded order (the data is read now)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.checkpoint)
    ids = torch.tensor(tokenizer(read_text(Path(args.data), tokenizer), add_special_tokens=False)["input_ids"])
    blocks = ids[: len(ids) // args.seq_len * args.seq_len].view(-1, args.seq_len)[rank::world]
    if len(blocks) < args.batch_size:
        raise UsageError(f"{args.data}: {len(ids)} tokens, too few for {world} ranks x --batch-size {args.batch_size} "
                         f"x --seq-len {args.seq_len}; pass a shorter --seq-len or more data")
    return _shuffled(blocks, args.batch_size, torch.Generator().manual_seed(args.seed))


def _shuffled(blocks: torch.Tensor, batch_size: int, g: torch.Generator) -> Iterator[torch.Tensor]:
    while True:
        order = torch.randperm(len(blocks), generator=g)
        for i in range(0, len(order) - batch_size + 1, batch_size):
            yield blocks[order[i: i + batch_size]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", help="a directory written by prequant convert")
    ap.add_argument("--data", default=str(CHATS), help="JSONL of conversations or texts, or a text file (default: "
                    "%(default)s)")
    ap.add_argument("--output", default="lora-adapter", help="where rank 0 saves the LoRA adapter")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batch-size", type=int, default=2, help="sequences per rank and step")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--lora-r", type=int, default=16)
    ap.add_argument("--lora-alpha", type=int, help="default: 2 x rank")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gradient-checkpointing", action="store_true", help="recompute activations in backward")
    args = ap.parse_args()
    if missing_launcher_env():  # plain `python`: no ranks to train on
        print(f"Error: {sys.argv[0]} runs on every rank of a launcher; run: torchrun --nproc_per_node 2 "
              f"{shlex.join(sys.argv)} (torchrun --nproc_per_node 1 for one GPU)", file=sys.stderr)
        sys.exit(2)

    device = init_distributed()  # NCCL on GPUs; gloo on the CPU, for trying the script without GPUs
    rank, world = dist.get_rank(), dist.get_world_size()
    data = batches(args, rank, world)

    t0 = time.monotonic()
    model = load_for_fsdp(args.checkpoint, lora_r=args.lora_r, lora_alpha=args.lora_alpha or 2 * args.lora_r,
                          seed=args.seed, device=device, gradient_checkpointing=args.gradient_checkpointing)
    if rank == 0:
        gpu = f", {torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB GPU peak" if device.type == "cuda" else ""
        print(f"loaded {args.checkpoint} on {world} ranks in {time.monotonic() - t0:.1f}s{gpu}", file=sys.stderr)

    params = [p for p in model.parameters() if p.requires_grad]  # the LoRA weights (DTensor shards)
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    for step in range(args.steps):
        batch = next(data).to(device)
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(params, 1.0)  # works on FSDP2's DTensor gradients
        opt.step()
        opt.zero_grad(set_to_none=True)
        mean = loss.detach().clone()
        dist.all_reduce(mean)  # SUM (gloo has no AVG), for the log line only
        if rank == 0:
            print(f"step {step + 1}/{args.steps} loss {mean.item() / world:.4f} grad-norm {float(norm):.3f}",
                  file=sys.stderr, flush=True)

    # Every rank takes part in gathering the LoRA shards (small); rank 0 writes the adapter.
    lora = {n: p.full_tensor().detach().cpu() for n, p in model.named_parameters() if p.requires_grad}
    if rank == 0:
        model.save_pretrained(args.output, state_dict=lora)
        print(f"saved the LoRA adapter to {args.output}", file=sys.stderr)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main()
    except PrequantError as e:
        print(f"Error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
