"""FSDP+QLoRA from a 4-bit checkpoint, each rank reading only its own shards.

`loader.load_for_fsdp` (the model, FSDP2-sharded, LoRA applied) with its parts: `checkpoint` (the files opened for
slicing), `sharding` (which rows a rank holds), `lora` (seeded LoRA init, the adapter-only state dict),
`distributed` (the process group), `compat` (torch before 2.12, accelerate on the CPU). `trainer.trainer_args`
sets up `transformers.Trainer`/TRL's `SFTTrainer` for the model. `check` (`prequant check-fsdp`) launches `job` on
every rank (`job_sft` for the SFTTrainer loader) and compares the `report`s."""

from __future__ import annotations

from .checkpoint import Checkpoint
from .distributed import default_device, ensure_process_group, init_distributed
from .loader import load_for_fsdp
from .lora import init_lora_weights, lora_config, lora_init_value
from .sharding import decoder_layers, local_rows, packed_layers, shard_rows
from .trainer import trainer_args

__all__ = ["Checkpoint", "decoder_layers", "default_device", "ensure_process_group", "init_distributed",
           "init_lora_weights", "load_for_fsdp", "local_rows", "lora_config", "lora_init_value", "packed_layers",
           "shard_rows", "trainer_args"]
