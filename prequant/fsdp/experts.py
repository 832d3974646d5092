"""MoE models for `load_for_fsdp`: one 4-bit linear per expert (`prequant convert --quantize-experts`), and LoRA on
each expert's projections; for layers whose experts the checkpoint keeps 16-bit (all of them without the flag, those
matched by `--skip` with it), transformers 5's own fused experts filled from the checkpoint's per-expert weights
(`bnb.moe.FusedExperts`).

transformers 5 builds a native MoE layer's experts fused (`bnb.experts`); `per_expert` puts `bnb.moe.PerExpert` in
the place of each layer's with 4-bit weights, with the checkpoint's keys renamed to the model's (transformers'
renaming tables: Mixtral's `block_sparse_moe` is `mlp`), so the loader then finds a 4-bit weight for every expert
linear like any other. peft 0.21 rewrites `gate_proj`/`up_proj`/`down_proj` (Mixtral's `w1`/`w3`/`w2`) targets on
such a model into the fused `gate_up_proj`/`down_proj` parameters, which the unfused layers do not have (that
rewrite exists to load adapters trained on transformers 4's per-expert layout into the fused one):
`lora_targets_as_named` keeps it from doing so, so each expert's linears get their own LoRA, named by expert in the
adapter's keys, and `lora_on_fused` gives the layers left fused the LoRA of their parameters that peft gives them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn

from ..bnb.moe import PerExpert, expert_roles, fused_experts, fused_from_experts, renamer, unfuse
from ..errors import PrequantError


def per_expert(model: nn.Module, ckpt: Any) -> bool:
    """Rename `ckpt`'s keys (a `loader.Checkpoint`) to `model`'s, unfuse the experts of each layer with 4-bit experts
    into 4-bit-ready linears, and put each fused parameter of the layers whose experts are kept 16-bit in
    `ckpt.fused` (a `bnb.moe.FusedExperts`). True when some layer was unfused."""
    fused = fused_experts(model)
    if not fused:
        return False
    rename = renamer(model)
    ckpt.tensors = {rename(k): ref for k, ref in ckpt.tensors.items()}
    ckpt.quantized = {rename(f"{p}.weight").removesuffix(".weight"): q for p, q in ckpt.quantized.items()}
    ckpt._state_keys = {rename(f"{p}.weight").removesuffix(".weight"): [rename(k) for k in keys]
                        for p, keys in ckpt._state_keys.items()}
    quantized = set(expert_roles(f"{p}.weight" for p in ckpt.quantized))
    kept = unfuse(model, expert_roles(ckpt.tensors), quantized)
    ckpt.fused = fused_from_experts(kept, ckpt.tensors, ckpt.view, ckpt.path)
    return bool(quantized)


def lora_on_fused(model: nn.Module, config: Any) -> None:
    """In a model with both per-expert (4-bit) and fused (16-bit) experts, give `config` (a peft LoraConfig) the fused
    experts' parameters as `target_parameters` where its targets name their projections, with the rank and alpha
    peft gives them on a fused model (gate and up are one parameter: twice each). On an all-fused model peft makes
    that rewrite itself; `lora_targets_as_named`, which the per-expert layers need, stops it for the whole model, so
    the fused layers get it here. Targeting gate without up (or up without gate) is refused."""
    from peft.tuners.tuners_utils import check_target_module_exists

    fused = fused_experts(model)
    names = next((e[0].names for e in model.modules() if isinstance(e, PerExpert)), None)
    if not fused or names is None:
        return
    every = isinstance(config.target_modules, str) and config.target_modules.lower() == "all-linear"
    params = []
    for name in fused:
        hit = {role for role, proj in names.items() if every or check_target_module_exists(config, f"{name}.0.{proj}")}
        if len(hit & {"gate", "up"}) == 1:
            raise PrequantError(f"{name}: LoRA on {names[next(iter(hit & {'gate', 'up'}))]} alone cannot go on these "
                                "16-bit experts, whose gate and up projections are one fused parameter; target "
                                f"{names['gate']} and {names['up']} together, or neither")
        params += [f"{name}.gate_up_proj"] * ("gate" in hit) + [f"{name}.down_proj"] * ("down" in hit)
    if not params:
        return
    config.target_parameters = sorted(set(config.target_parameters or []) | set(params))
    if any(p.endswith(".gate_up_proj") for p in params):
        config.rank_pattern = {**(config.rank_pattern or {}), r".*\.gate_up_proj": 2 * config.r}
        config.alpha_pattern = {**(config.alpha_pattern or {}), r".*\.gate_up_proj": 2 * config.lora_alpha}


@contextmanager
def lora_targets_as_named(model: nn.Module) -> Iterator[None]:
    """peft sees no transformers 4 -> 5 MoE conversion for `model` (its experts are per expert already), so
    target modules keep their names; the model's type is restored after. An adapter loaded inside that targets the
    fused expert parameters of layers whose experts are per expert here (one trained on 16-bit experts) is refused:
    peft would drop those LoRA weights with a warning and give the model without them."""
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
    _refuse_fused_lora(model)


def _refuse_fused_lora(model: nn.Module) -> None:
    """Raise PrequantError when an adapter on `model` (peft's `peft_config`, set on the model it wraps) names a
    fused experts parameter (`target_parameters`, matched as peft matches them: the name or a dotted suffix of it)
    of a layer that holds its experts per expert."""
    per_expert = [name for name, module in model.named_modules() if isinstance(module, PerExpert)]
    for adapter, config in (getattr(model, "peft_config", None) or {}).items():
        for target in getattr(config, "target_parameters", None) or []:
            leaf = target.rpartition(".")[2]
            if leaf not in ("gate_up_proj", "down_proj"):
                continue
            for name in per_expert:
                param = f"{name}.{leaf}"
                if param == target or param.endswith(f".{target}"):
                    raise PrequantError(
                        f"adapter {adapter!r} holds LoRA of {param}, fused 16-bit experts, but this model's {name} "
                        "holds 4-bit experts one linear each: peft would drop those LoRA weights. Load it on "
                        "prequant.load_model of the checkpoint it was trained on (converted without "
                        "--quantize-experts), or merge it into this one with `prequant merge`")
