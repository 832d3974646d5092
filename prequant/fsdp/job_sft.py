"""check-fsdp's `trainer` loader: `load_for_fsdp`, then TRL's `SFTTrainer` trains the job's fixed batch, as a
user's script would (`prequant.fsdp.trainer_args`, bf16, the process group set up the way Trainer does it).

What the job compares is the first-step loss, so the run is set up to see exactly the batch the other loaders see:
a pre-tokenized dataset of the batch's rows repeated, sampled in order, `per_device_train_batch_size` = the batch,
so every rank's every step is the batch (the other loaders give every rank the same batch too). The optimizer is
the plain loop's (AdamW, constant learning rate, no weight decay, no gradient clipping) and gradient checkpointing
is off, as there. The batch is token ids: SFTTrainer still wants a tokenizer (for its pad token), so it gets a
two-token one rather than the checkpoint's, which an 8B-shaped random checkpoint does not have.
"""

from __future__ import annotations

import math
import os
import sys
import tempfile
from typing import Any

import torch

from .trainer import trainer_args


def train_sft(model: torch.nn.Module, batch: torch.Tensor, options: Any) -> tuple[list[float], bool]:
    """Train `options.steps` steps of `batch` with SFTTrainer; returns (per-step losses, first-step LoRA gradients
    all finite). The losses are Trainer's logged ones (`logging_steps=1`): each the mean over all ranks."""
    import torch.distributed as dist
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import SFTConfig, SFTTrainer

    world = dist.get_world_size()
    rows = [row.tolist() for row in batch.cpu()] * (world * options.steps)
    grads = {"finite": False, "seen": False}

    class Probe(TrainerCallback):
        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
            if not grads["seen"]:  # the first step's gradients, before the optimizer uses them
                grads["seen"] = True
                local = [_local(p.grad) for p in model.parameters() if p.requires_grad and p.grad is not None]
                grads["finite"] = bool(local) and all(bool(torch.isfinite(g).all()) for g in local)

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
            if state.is_world_process_zero and logs and "loss" in logs:
                print(f"check-fsdp: step {state.global_step}/{options.steps} loss {logs['loss']:.6f}",
                      file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory(prefix="prequant-check-fsdp-sft-") as out:
        config = SFTConfig(
            output_dir=out, max_steps=options.steps, per_device_train_batch_size=batch.shape[0],
            gradient_accumulation_steps=1, learning_rate=options.lr, lr_scheduler_type="constant", weight_decay=0.0,
            max_grad_norm=0.0, optim="adamw_torch", logging_steps=1, save_strategy="no", report_to="none",
            bf16=True, use_cpu=batch.device.type == "cpu", gradient_checkpointing=False,
            train_sampling_strategy="sequential", max_length=batch.shape[1], seed=options.seed, disable_tqdm=True)
        dataset = Dataset.from_dict({"input_ids": rows})
        trainer = SFTTrainer(model=model, args=trainer_args(config), train_dataset=dataset,
                             processing_class=_pad_tokenizer(), callbacks=[Probe()])
        trainer.train()
    losses = [float(h["loss"]) for h in trainer.state.log_history if "loss" in h]
    return losses, grads["finite"] and all(math.isfinite(x) for x in losses)


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _pad_tokenizer() -> Any:
    """A tokenizer that only knows a pad token (id 0) and an unknown token: all SFTTrainer needs for token ids."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    tok = Tokenizer(models.WordLevel({"<pad>": 0, "<unk>": 1}, unk_token="<unk>"))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>")
