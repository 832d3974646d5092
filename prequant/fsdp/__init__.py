"""FSDP+QLoRA from a 4-bit checkpoint, each rank reading only its own shards.

`loader.load_for_fsdp` builds the model (FSDP2-sharded, LoRA applied; with it the checkpoint opened for slicing,
which rows a rank holds, the LoRA init and the process group); `trainer.trainer_args` sets up
`transformers.Trainer` or TRL's `SFTTrainer` for that model; `compat` holds the workarounds for library releases
that need them."""

from __future__ import annotations

from .loader import (
    Checkpoint,
    decoder_layers,
    default_device,
    ensure_process_group,
    init_distributed,
    init_lora_weights,
    load_for_fsdp,
    local_rows,
    lora_config,
    lora_init_value,
    missing_launcher_env,
    packed_layers,
    shard_rows,
)
from .trainer import trainer_args

__all__ = ["Checkpoint", "decoder_layers", "default_device", "ensure_process_group", "init_distributed",
           "init_lora_weights", "load_for_fsdp", "local_rows", "lora_config", "lora_init_value",
           "missing_launcher_env", "packed_layers", "shard_rows", "trainer_args"]
