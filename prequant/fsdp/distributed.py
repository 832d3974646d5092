"""The process group and device of one rank: how `load_for_fsdp`, check-fsdp's job and the example script set
up torch.distributed under torchrun."""

from __future__ import annotations

import os

import torch


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


def default_device() -> torch.device:
    """cuda:LOCAL_RANK when CUDA is available, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")
