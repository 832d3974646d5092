"""The process group and device of one rank: how `load_for_fsdp`, check-fsdp's job and the example scripts set
up torch.distributed under torchrun or `accelerate launch`."""

from __future__ import annotations

import os

import torch

from ..errors import UsageError

# What torchrun (and so `accelerate launch`, which runs it) exports to every rank.
LAUNCHER_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def init_distributed() -> torch.device:
    """Under torchrun: this rank's device (`default_device`), made current, and the process group on it
    (NCCL on GPUs, gloo on the CPU). Returns the device."""
    import torch.distributed as dist

    device = default_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")
    return device


def ensure_process_group(device: torch.device) -> None:
    """Set up the process group when none exists yet, the way the Hugging Face Trainer will.

    accelerate's `PartialState` is what `TrainingArguments` (hence Trainer and TRL) initializes torch.distributed
    with; doing it through the same call here means a script may create its model before or after its
    `TrainingArguments`: both see one process group on one backend (NCCL on GPUs; gloo on the CPU, as with
    `use_cpu=True`), and `TrainingArguments` created later reuses it. Without a launcher there is no group to
    join: that is a usage error, also for a single GPU (`torchrun --nproc_per_node 1`)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return
    missing = [k for k in LAUNCHER_ENV if k not in os.environ]
    if not dist.is_available() or missing:
        raise UsageError(
            "load_for_fsdp needs torch.distributed: run the script under torchrun or accelerate launch (also for one "
            f"GPU: torchrun --nproc_per_node 1), or call init_process_group first (not set: {', '.join(missing)})"
        )
    from accelerate import PartialState

    PartialState(cpu=device.type == "cpu")
    if not dist.is_initialized():
        raise UsageError(f"accelerate set up no process group for device {device}; call init_process_group first")


def default_device() -> torch.device:
    """cuda:LOCAL_RANK when CUDA is available, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")
