"""MoE models for `load_for_fsdp`: one 4-bit linear per expert (`prequant convert --quantize-experts`), and LoRA on
each expert's projections; or, for a checkpoint whose experts were kept 16-bit, transformers 5's own fused experts
filled from the checkpoint's per-expert weights (`FusedExperts`).

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

import torch
from torch import nn

from ..bnb.experts import ROLES, expert_match
from ..bnb.moe import expert_roles, fused_experts, renamer, unfuse
from ..errors import PrequantError


def per_expert(model: nn.Module, ckpt: Any) -> bool:
    """Rename `ckpt`'s keys (a `loader.Checkpoint`) to `model`'s and, with 4-bit experts, unfuse the model's experts
    into 4-bit-ready linears (True). With 16-bit experts the model keeps its fused experts, each fused parameter a
    `FusedExperts` in `ckpt.fused` (False); False too when the model has no fused experts."""
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
        ckpt.fused = fused_from_experts(fused, ckpt)
        return False
    unfuse(model, roles)
    return True


class FusedExperts:
    """One fused experts parameter of transformers 5 (`gate_up_proj` [E, 2I, H]: each expert's gate rows, then its up
    rows; `down_proj` [E, H, I]) as the checkpoint's per-expert 16-bit weights make it: `keys[e]` are expert e's
    tensors, concatenated in that order. `copy_rows` fills experts [start, stop) only: a rank reads its own experts."""

    def __init__(self, ckpt: Any, keys: list[list[str]]) -> None:
        self.ckpt, self.keys = ckpt, keys
        first = [ckpt.tensors[k].shape for k in keys[0]]
        self.shape = (len(keys), sum(s[0] for s in first), first[0][1])

    def copy_rows(self, out: torch.Tensor, start: int, stop: int) -> None:
        for i, parts in enumerate(self.keys[start:stop]):
            row = 0
            for key in parts:
                value = self.ckpt.view(key)
                out[i, row : row + value.shape[0]].copy_(value)
                row += value.shape[0]


def fused_from_experts(fused: dict[str, nn.Module], ckpt: Any) -> dict[str, FusedExperts]:
    """{fused parameter name: FusedExperts} for each of the model's fused experts modules, from `ckpt`'s per-expert
    weights (model names); a missing expert weight is refused, naming it."""
    found: dict[str, dict[int, dict[str, str]]] = {}  # experts module -> expert -> role -> key
    for key in ckpt.tensors:
        if (m := expert_match(key)) is not None:
            found.setdefault(f"{m['block']}.experts", {}).setdefault(int(m["index"]), {})[ROLES[m["proj"]]] = key
    out: dict[str, FusedExperts] = {}
    for name, module in fused.items():
        experts = found.get(name, {})
        count = module.gate_up_proj.shape[0]
        keys: dict[str, list[list[str]]] = {"gate_up_proj": [], "down_proj": []}
        for e in range(count):
            roles = experts.get(e, {})
            missing = [r for r in ("gate", "up", "down") if r not in roles]
            if missing:
                raise PrequantError(f"{ckpt.path}: no {missing[0]} projection weight for expert {e} of {name}; "
                                    "load_for_fsdp needs every expert's weights (is this a complete checkpoint?)")
            keys["gate_up_proj"].append([roles["gate"], roles["up"]])
            keys["down_proj"].append([roles["down"]])
        for param, parts in keys.items():
            out[f"{name}.{param}"] = FusedExperts(ckpt, parts)
    return out



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
