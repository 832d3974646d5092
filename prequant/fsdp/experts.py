"""MoE models for `load_for_fsdp`: one 4-bit linear per expert (`prequant convert --quantize-experts`), and LoRA on
each expert's projections.

transformers 5 builds a native MoE layer's experts fused (`bnb.experts`); `per_expert` puts `bnb.moe.PerExpert` in
their place, with the checkpoint's keys renamed to the model's (transformers' renaming tables: Mixtral's
`block_sparse_moe` is `mlp`), so the loader then finds a 4-bit weight for every expert linear like any other.
peft 0.21 rewrites `gate_proj`/`up_proj`/`down_proj` (Mixtral's `w1`/`w3`/`w2`) targets on such a model into the
fused `gate_up_proj`/`down_proj` parameters, which this model does not have (that rewrite exists to load adapters
trained on transformers 4's per-expert layout into the fused one): `lora_targets_as_named` keeps it from doing so,
so each expert's linears get their own LoRA, named by expert in the adapter's keys.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn

from ..bnb.moe import expert_roles, fused_experts, renamer, unfuse
from ..errors import PrequantError


def per_expert(model: nn.Module, ckpt: Any) -> bool:
    """Unfuse `model`'s experts into 4-bit-ready linears and rename `ckpt`'s keys (a `loader.Checkpoint`) to the model's; False when the
    model has no fused experts. A MoE checkpoint without 4-bit experts is refused (PrequantError)."""
    fused = fused_experts(model)
    if not fused:
        return False
    rename = renamer(model)
    ckpt.tensors = {rename(k): ref for k, ref in ckpt.tensors.items()}
    ckpt.quantized = {rename(f"{p}.weight").removesuffix(".weight"): q for p, q in ckpt.quantized.items()}
    ckpt._state_keys = {rename(f"{p}.weight").removesuffix(".weight"): [rename(k) for k in keys]
                        for p, keys in ckpt._state_keys.items()}
    roles = expert_roles(ckpt.quantized)
    if not roles:
        raise PrequantError(f"{ckpt.path}: its MoE experts ({next(iter(fused))}, ...) are not 4-bit; load_for_fsdp "
                            "trains MoE models with 4-bit experts: convert the source with --quantize-experts")
    unfuse(model, roles)
    return True


@contextmanager
def lora_targets_as_named(model: nn.Module) -> Iterator[None]:
    """peft sees no transformers 4 -> 5 MoE conversion for `model` (its experts are per expert already), so
    target modules keep their names; the model's type is restored after."""
    config = model.config
    own = "model_type" in vars(config)
    model_type: Any = config.model_type
    config.model_type = f"{model_type}-per-expert"
    try:
        yield
    finally:
        if own:
            config.model_type = model_type
        else:
            del config.model_type
