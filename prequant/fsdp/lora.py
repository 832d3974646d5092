"""LoRA on a 4-bit model: peft's config as both loaders use it, and an initialization that gives the same weights
on any number of ranks (seeded by name, not by the order of random draws)."""

from __future__ import annotations

import math
import zlib
from typing import Any

import torch


def lora_init_value(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """The initial fp32 value of the LoRA parameter `name` (as named in the peft model): B is zero, A is
    peft's default kaiming-uniform (bound 1/sqrt(fan_in)) from a generator seeded by `seed` and the name."""
    if ".lora_B." in name:
        return torch.zeros(shape, dtype=torch.float32)
    g = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
    bound = 1.0 / math.sqrt(shape[1]) if len(shape) > 1 and shape[1] else 0.0
    return torch.empty(shape, dtype=torch.float32).uniform_(-bound, bound, generator=g)


def init_lora_weights(model: torch.nn.Module, seed: int = 0) -> None:
    """Set every LoRA A/B of an unsharded peft model to `lora_init_value`: how a non-sharded reference (or
    transformers' FSDP path, before wrapping) gets exactly the LoRA weights `load_for_fsdp` gives."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_A." in name or ".lora_B." in name:
                p.copy_(lora_init_value(name, tuple(p.shape), seed))


def lora_config(r: int, alpha: int, dropout: float, target_modules: str | list[str]) -> Any:
    """The peft LoraConfig both loaders use."""
    from peft import LoraConfig

    return LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=target_modules, bias="none",
                      task_type="CAUSAL_LM")


def apply_lora(model: torch.nn.Module, r: int, alpha: int, dropout: float, target_modules: str | list[str]) -> Any:
    """`model` wrapped by peft with `lora_config(...)`'s adapters (still on the meta device when the model is)."""
    from peft import get_peft_model

    return get_peft_model(model, lora_config(r, alpha, dropout, target_modules))
