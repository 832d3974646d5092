"""Supervised fine-tuning of a prequant 4-bit checkpoint with TRL's SFTTrainer, FSDP+QLoRA; every rank reads only
its own shards of the checkpoint.

    torchrun --nproc_per_node 8 scripts/sft_trl.py ./grok-1-nf4 --trust-remote-code --data chats.jsonl \\
        --max-seq-length 2048 --steps 500 --output ./grok-1-lora
    accelerate launch --num_processes 8 scripts/sft_trl.py ./llama3-8b-nf4 --data train.jsonl --output ./lora

One GPU too, under a launcher: `torchrun --nproc_per_node 1 scripts/sft_trl.py ...`.

--data is a local JSONL file (default: the example conversations, scripts/data/chats.jsonl), one example per line,
either plain text or a conversation:

    {"text": "The quick brown fox ..."}
    {"messages": [{"role": "user", "content": "What is 2 + 4?"}, {"role": "assistant", "content": "6"}]}

Conversations are rendered with the tokenizer's chat template (TRL does it); texts get the EOS token appended.
Sequences are cut at --max-seq-length tokens. The tokenizer is the checkpoint's (prequant convert copies it), or
--tokenizer.

This is TRL's QLoRA recipe (`trl/scripts/sft.py` with a 4-bit model and `--use_peft`, under an FSDP accelerate
config) with two changes: the model is `prequant.load_for_fsdp(...)`, which builds it on the meta device, applies
LoRA, shards it with FSDP2 and fills each rank's shards from the memory-mapped checkpoint, instead of a model id
that every rank loads whole; and the arguments go through `prequant.fsdp.trainer_args`, which sets the FSDP options
that make Trainer take an already sharded model as it is (see its docstring). The rest is plain SFTTrainer:
bf16, gradient accumulation, gradient checkpointing (on by default, as in TRL), logging, checkpoints every
--save-steps that --resume continues from, and at the end `trainer.save_model()` writes the peft adapter to
--output: `PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(checkpoint), output)` loads it unsharded.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from prequant.errors import PrequantError
from prequant.fsdp import missing_launcher_env

CHATS = Path(__file__).resolve().parent / "data" / "chats.jsonl"


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", help="a directory written by prequant convert")
    ap.add_argument("--data", default=str(CHATS), help="JSONL file: {'text': ...} or {'messages': [...]} per line "
                    "(default: %(default)s)")
    ap.add_argument("--output", default="sft-lora", help="where the adapter (and the checkpoints) are written")
    ap.add_argument("--steps", type=int, default=100, help="optimizer steps")
    ap.add_argument("--max-seq-length", type=int, default=1024, help="tokens per example, longer ones are cut")
    ap.add_argument("--batch-size", type=int, default=1, help="examples per rank and micro-step")
    ap.add_argument("--grad-accum", type=int, default=1, help="micro-steps per optimizer step")
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--lora-r", type=int, default=16)
    ap.add_argument("--lora-alpha", type=int, help="default: 2 x rank")
    ap.add_argument("--lora-dropout", type=float, default=0.0)
    ap.add_argument("--no-gradient-checkpointing", action="store_true", help="keep activations instead")
    ap.add_argument("--save-steps", type=int, default=100, help="write a checkpoint every N steps (0: none)")
    ap.add_argument("--resume", help="a checkpoint directory of an earlier run (OUTPUT/checkpoint-N) to continue")
    ap.add_argument("--logging-steps", type=int, default=1)
    ap.add_argument("--tokenizer", help="default: the checkpoint's")
    ap.add_argument("--trust-remote-code", action="store_true", help="run the checkpoint's own model code (Grok-1)")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


def main() -> None:
    args = parse()
    if missing_launcher_env():  # plain `python`: no ranks to train on
        print(f"Error: {sys.argv[0]} runs on every rank of a launcher; run: torchrun --nproc_per_node 2 "
              f"{shlex.join(sys.argv)} (or accelerate launch; torchrun --nproc_per_node 1 for one GPU)", file=sys.stderr)
        sys.exit(2)
    from datasets import load_dataset
    from transformers import AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    from prequant.fsdp import load_for_fsdp, trainer_args

    # Change 1 of TRL's recipe: the model, sharded while it loads (also sets up the process group, as Trainer would).
    model = load_for_fsdp(args.checkpoint, lora_r=args.lora_r, lora_alpha=args.lora_alpha or 2 * args.lora_r,
                          lora_dropout=args.lora_dropout, seed=args.seed, trust_remote_code=args.trust_remote_code)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.checkpoint,
                                              trust_remote_code=args.trust_remote_code)
    dataset = load_dataset("json", data_files=args.data, split="train")
    config = SFTConfig(
        output_dir=args.output, max_steps=args.steps, max_length=args.max_seq_length,
        per_device_train_batch_size=args.batch_size, gradient_accumulation_steps=args.grad_accum,
        learning_rate=args.lr, bf16=True, use_cpu=not torch.cuda.is_available(),
        gradient_checkpointing=not args.no_gradient_checkpointing, logging_steps=args.logging_steps,
        save_strategy="steps" if args.save_steps else "no", save_steps=args.save_steps or 500,
        report_to="none", seed=args.seed)
    # Change 2: the FSDP settings for a model that arrives sharded.
    trainer = SFTTrainer(model=model, args=trainer_args(config), train_dataset=dataset, processing_class=tokenizer)
    trainer.train(resume_from_checkpoint=args.resume)
    trainer.save_model(args.output)
    trainer.accelerator.print(f"saved the LoRA adapter to {args.output}")
    trainer.accelerator.wait_for_everyone()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    try:
        main()
    except PrequantError as e:
        print(f"Error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
