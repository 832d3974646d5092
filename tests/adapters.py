"""Tiny peft adapters for the merge tests: built by peft itself on a tiny base (helpers.build_checkpoint), with every
trained tensor random and non-zero (B, DoRA magnitudes, modules_to_save copies), and what peft makes of them."""

from __future__ import annotations

from pathlib import Path

import torch


def load_base(path: Path, dtype: torch.dtype | None = None):
    """The base as transformers loads it (its own dtype unless given)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype or "auto")


def make_adapter(base: Path, out: Path, *, seed: int = 0, dtype: torch.dtype = torch.float32, **lora) -> Path:
    """Train nothing: build a peft LoRA adapter on `base` with `lora` as its LoraConfig and every trained tensor
    random (B non-zero, DoRA magnitudes and modules_to_save copies moved off their initial values); save it."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = load_base(base, dtype)
    config = LoraConfig(init_lora_weights=False, **{"r": 4, "lora_alpha": 8, **lora})
    peft_model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name or "lora_embedding_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.05)
            elif "lora_magnitude_vector" in name:
                p.mul_(1 + 0.1 * torch.rand(p.shape, generator=generator))
            elif "modules_to_save" in name:
                p.add_(torch.randn(p.shape, generator=generator).to(p.dtype) * 0.01)
    peft_model.save_pretrained(out)
    return out


def peft_merged(base: Path, adapter: Path, **load) -> dict[str, torch.Tensor]:
    """peft's merge_and_unload of `adapter` into `base` as transformers loads it; its state dict."""
    from peft import PeftModel

    model = PeftModel.from_pretrained(load_base(base), adapter, **load)
    return {k: v.detach().clone() for k, v in model.merge_and_unload().state_dict().items()}


def peft_logits(base: Path, adapter: Path, tokens: torch.Tensor) -> torch.Tensor:
    """PeftModel(base, adapter)'s logits: the adapted model unmerged."""
    from peft import PeftModel

    model = PeftModel.from_pretrained(load_base(base), adapter).eval()
    with torch.no_grad():
        return model(tokens).logits.float()


def logits(path: Path, tokens: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype="auto").eval()
    with torch.no_grad():
        return model(tokens).logits.float()


TOKENS = torch.arange(1, 17).view(2, 8) * 7 % 250
