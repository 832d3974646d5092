"""LoRA on a 4-bit model: peft's config as both loaders use it, an initialization that gives the same weights on
any number of ranks (seeded by name, not by the order of random draws), and a state dict that holds what
training changes (the adapter), not the frozen checkpoint."""

from __future__ import annotations

import math
import zlib
from typing import Any

import torch

from ..bnb.format import COMPANIONS, entry_key, split_state_key


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


def keep_frozen_weights_out_of_state_dict(model: torch.nn.Module) -> None:
    """Make `model.state_dict()` hold its trainable weights and buffers, and each frozen weight as an empty tensor.

    The frozen weights are the checkpoint's own, which training never changes; but whatever saves a state dict
    under FSDP gathers every tensor in it first: `Trainer.save_model` (accelerate's FULL_STATE_DICT) would put
    the whole 4-bit model on rank 0 (Grok-1: 165 GB) to write a LoRA adapter of a few MB. The keys stay, with an
    empty value, because torch's `get_model_state_dict(ignore_frozen_params=True)` (accelerate's adapter-only
    checkpoints) pops frozen weights by name; bitsandbytes' entries of a frozen 4-bit weight (absmax, code
    tables, quant-state JSON) are left out."""

    def hook(module: torch.nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
        frozen = {prefix + n: p.dtype for n, p in module.named_parameters() if not p.requires_grad}
        companions = {entry_key(w, c) for w in frozen for c in COMPANIONS}
        for key in list(state_dict):
            if key in frozen:
                state_dict[key] = torch.empty(0, dtype=frozen[key])
            elif key in companions or (split_state_key(key) or ("",))[0] in frozen:
                del state_dict[key]

    model.register_state_dict_post_hook(hook)
