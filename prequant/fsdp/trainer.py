"""Train a `load_for_fsdp` model with `transformers.Trainer` or TRL's `SFTTrainer`, under torchrun or accelerate launch.

    model = prequant.load_for_fsdp("llama3-8b-nf4", lora_r=16, lora_alpha=32)
    args = prequant.fsdp.trainer_args(SFTConfig(output_dir="out", bf16=True, max_steps=100))
    SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer).train()

The model arrives sharded (FSDP2 `fully_shard`, each rank holding only its rows); `trainer_args` returns a copy
of the script's arguments with the FSDP settings that make Trainer and accelerate take it as it is:

- FSDP, version 2. Without an FSDP plugin accelerate wraps the model in DDP, which fails on DTensor parameters
  (and would reduce again what FSDP2 reduces). With one, accelerate recognizes a model that `fully_shard` already
  sharded and leaves it alone: its sharding, its mixed-precision policy (bf16 compute, fp32 LoRA masters and
  gradient reduction, so `bf16=True` computes what the plain loop does; accelerate adds no autocast for FSDP2);
  and Trainer saves through its FSDP paths, collectively.
- No auto-wrap policy: the model is wrapped already, and accelerate's transformer-based policy looks the decoder
  layers up by class name, which `fully_shard` changed (`LlamaDecoderLayer` -> `FSDPLlamaDecoderLayer`): it would
  raise "Could not find the transformer layer class".
- FULL_STATE_DICT: `trainer.save_model()` writes the peft adapter, and checkpoints hold the adapter and the
  optimizer state. Both gather the LoRA weights alone, because the model's `state_dict()` leaves the frozen
  checkpoint out (`loader.keep_frozen_weights_out_of_state_dict`); under SHARDED_STATE_DICT Trainer's `save_model`
  writes no adapter at all.
- On the CPU (gloo ranks): `use_cpu=True`, and accelerate's FSDP path enabled
  there (`compat.ensure_accelerate_cpu_fsdp`).

Refused, with the reason: FSDP1, SHARDED_STATE_DICT, FSDP's own activation checkpointing (accelerate wraps layers
by the auto-wrap policy; `gradient_checkpointing=True` works with the FSDP2 units instead), CPU offload (the model
is sharded without it), and checkpoints on more than one rank with accelerate before 1.15, whose FSDP2 adapter-only
checkpoints hold rank 0's shards of the adapter alone (resuming would restore wrong LoRA weights on every other
rank); `trainer.save_model()` is not affected. `reshard_after_forward` belongs to `load_for_fsdp`, which shards.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, TypeVar

from .. import settings
from ..errors import UsageError
from .compat import ensure_accelerate_cpu_fsdp
from .loader import default_device

Args = TypeVar("Args")

# The fsdp_config that trainer_args sets (transformers' key names, without their optional "fsdp_" prefix).
FSDP_CONFIG = {"version": 2, "auto_wrap_policy": "NO_WRAP", "state_dict_type": "FULL_STATE_DICT",
               "activation_checkpointing": False}


def trainer_args(args: Args) -> Args:
    """A copy of `args` (`TrainingArguments`, `SFTConfig` or another subclass) set up for a `load_for_fsdp` model.

    Sets `fsdp=True` and the `fsdp_config` entries of `FSDP_CONFIG` (see the module docstring for why each), keeps
    the rest of the script's `fsdp_config`, and `use_cpu=True` on a machine without CUDA. Raises UsageError for a
    setting that cannot work with a model `load_for_fsdp` sharded. Call it once per arguments object; the result is
    a new object (`dataclasses.replace`), whatever built the original (a script, `HfArgumentParser`, `TrlParser`)."""
    if not dataclasses.is_dataclass(args) or not hasattr(args, "fsdp_config"):
        raise UsageError(f"trainer_args takes TrainingArguments or SFTConfig, not {type(args).__name__}")
    config = _fsdp_config(args)
    check_checkpoints(args, settings.world_size())  # the launcher's: there may be no group yet
    changes: dict[str, Any] = {"fsdp": True, "fsdp_config": {**config, **FSDP_CONFIG}}
    if default_device().type == "cpu":
        changes["use_cpu"] = True
        ensure_accelerate_cpu_fsdp()
    return dataclasses.replace(args, **changes)


def accelerate_gathers_adapter_checkpoints() -> bool:
    """Whether accelerate's FSDP2 adapter-only checkpoints gather the adapter under FULL_STATE_DICT (1.15 and later,
    read from its code): earlier releases pickle rank 0's shards of it, and restore them on rank 0 alone."""
    import inspect

    from accelerate.utils import fsdp_utils

    try:
        return "full_state_dict" in inspect.getsource(fsdp_utils._get_model_state_dict)
    except (AttributeError, OSError, TypeError):  # no such function, or no source: assume the old behaviour
        return False


def check_checkpoints(args: Any, ranks: int) -> None:
    """Raise UsageError when Trainer would write checkpoints that resume wrongly: `ranks` > 1 and an accelerate whose
    adapter checkpoints do not gather the adapter (`accelerate_gathers_adapter_checkpoints`)."""
    if str(getattr(args, "save_strategy", "no")).rpartition(".")[2].lower() == "no" or ranks < 2:
        return
    import accelerate

    if not accelerate_gathers_adapter_checkpoints():
        raise UsageError(f"accelerate {accelerate.__version__} writes Trainer checkpoints of a sharded peft adapter "
                         "from rank 0's shards alone, so resuming would be wrong (fixed in accelerate 1.15): "
                         "upgrade accelerate, or set save_strategy='no' (trainer.save_model() is not affected)")


def _fsdp_config(args: Any) -> dict[str, Any]:
    """The script's fsdp_config as a dict of transformers' key names, after refusing what cannot work."""
    # Settings missing from fsdp_config come from what `accelerate launch` exports (FSDP_*), as accelerate reads them.
    raw = args.fsdp_config or {}
    if isinstance(raw, str):  # transformers also takes a path to a JSON file
        with open(raw, encoding="utf-8") as f:
            raw = json.load(f)
    config = {k.removeprefix("fsdp_"): v for k, v in raw.items()}
    fsdp = args.fsdp if isinstance(args.fsdp, (list, tuple)) else str(args.fsdp or "").split()
    if int(config.get("version", 2)) != 2:
        raise UsageError(f"fsdp_config version {config['version']}: load_for_fsdp shards with FSDP2 (fully_shard); "
                         "leave the version out")
    state_dict_type = str(config.get("state_dict_type", settings.accelerate_fsdp("FSDP_STATE_DICT_TYPE") or "FULL_STATE_DICT"))
    if "SHARDED" in state_dict_type.upper():
        raise UsageError("fsdp_config state_dict_type SHARDED_STATE_DICT: Trainer.save_model writes no adapter under "
                         "it; leave it out (FULL_STATE_DICT gathers only the LoRA weights of a load_for_fsdp model)")
    if _true(config.get("activation_checkpointing", settings.accelerate_fsdp("FSDP_ACTIVATION_CHECKPOINTING"))):
        raise UsageError("fsdp_config activation_checkpointing: accelerate wraps layers by an auto-wrap policy, and "
                         "the model is wrapped already; use gradient_checkpointing=True instead")
    if _true(config.get("cpu_offload", settings.accelerate_fsdp("FSDP_OFFLOAD_PARAMS"))) or "offload" in fsdp:
        raise UsageError("fsdp offload: load_for_fsdp shards without CPU offload, and accelerate does not re-shard "
                         "a sharded model; leave offload out")
    return config


def _true(value: Any) -> bool:
    return str(value).strip().lower() in ("1", "true", "yes")
