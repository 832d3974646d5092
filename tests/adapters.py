"""Tiny peft adapters for the merge tests: built by peft itself on a tiny base (helpers.build_checkpoint), with every
trained tensor random and non-zero (B, DoRA magnitudes, modules_to_save copies), and what peft makes of them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from helpers import read_checkpoint


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


def altered(adapter: Path, out: Path, *, config: dict | None = None,
            tensors: dict[str, torch.Tensor | None] | None = None) -> Path:
    """A copy of `adapter` at `out` with `config`'s keys set in its adapter_config.json and `tensors` put in its
    weights (by key without peft's `base_model.model.` prefix; None removes one): a hostile or broken adapter."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(adapter, out)
    if config:
        path = out / "adapter_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    if tensors:
        weights = load_file(out / "adapter_model.safetensors")
        for key, value in tensors.items():
            if value is None:
                del weights["base_model.model." + key]
            else:
                weights["base_model.model." + key] = value
        save_file(weights, out / "adapter_model.safetensors", metadata={"format": "pt"})
    return out


def assert_logits_close(ours: torch.Tensor, reference: torch.Tensor) -> None:
    """Equal within bf16 rounding: the merged weights are rounded once to bf16, the adapted model adds the LoRA
    path in its own precision."""
    assert (ours - reference).abs().max().item() <= 2e-2 * reference.abs().max().item()


def assert_same_as_peft(out: Path, base: Path, adapter: Path) -> dict[str, torch.Tensor]:
    """The merged checkpoint at `out` holds peft's merge_and_unload bytes, and its logits are the adapted model's."""
    ours, ref = read_checkpoint(out), peft_merged(base, adapter)
    assert set(ours) == set(ref) - {k for k in ref if k not in read_checkpoint(base)}
    different = [k for k in ours if not torch.equal(ours[k], ref[k])]
    assert different == []
    assert_logits_close(logits(out, TOKENS), peft_logits(base, adapter, TOKENS))
    return ours
