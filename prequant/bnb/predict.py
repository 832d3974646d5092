"""The layout transformers will decide, predicted from tensor names alone, for architectures whose rules are known.

`layout.analyze` asks transformers (a model built on the meta device), which costs its modeling imports: seconds
of one core before anything can be planned. For the common architectures the answer follows from the names:
which modules are `nn.Linear` (or GPT-2's `Conv1D`), that the output embedding stays unquantized, which MoE
experts transformers 5 fuses. `predict` returns that Layout, in exactly the form `analyze` gives it (same
reasons, dtypes, method and skip list), so that a conversion can start on it at once. It is only ever a
head start: the conversion still asks transformers, compares the two before it publishes anything, and
starts again on transformers' layout when they differ (`conversion.layouts`). None where the rules are not
known here (another architecture, transformers 4, remote code not trusted, a `_keep_in_fp32` model...).

PREQUANT_PREDICT_LAYOUT=0 turns prediction off (every conversion then waits for transformers, as before).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace
from importlib import metadata

from ..checkpoint.tensors import TensorRef
from .layout import Decision, Family, Layout, _which_skip, detect_family
from .loading import cast_code, load_dtype, should_convert, unmatched_by_4x

ENV = "PREQUANT_PREDICT_LAYOUT"


@dataclass(frozen=True)
class Rules:
    """What transformers' model of one architecture holds, by name (model keys, as transformers names them)."""

    params: re.Pattern[str]  # the model's parameters (a checkpoint tensor outside them is loaded as stored)
    linear: re.Pattern[str]  # modules transformers replaces with 4-bit layers
    conv1d: bool = False  # those modules are GPT-2 Conv1D, stored [in, out]
    prefix: str = ""  # base-model prefix transformers adds to keys saved without it (GPT-2's own checkpoints)
    fused: tuple[tuple[re.Pattern[str], str], ...] = ()  # checkpoint key -> the 3-D parameter transformers 5 fuses
    # With tied embeddings transformers also keeps the input embedding and the module of the last parameter.
    tied_keep: tuple[str, ...] = ("model.embed_tokens", "model.norm")
    tied_default: bool = False  # the config class' tie_word_embeddings when config.json does not say


_NORMS = r"layers\.\d+\.\w*norm\.weight|layers\.\d+\.self_attn\.[qk]_norm\.weight|norm\.weight"
_ATTENTION = r"layers\.\d+\.self_attn\.[qkvo]_proj"
_DECODER = Rules(
    params=re.compile(rf"^(lm_head\.weight|model\.(embed_tokens\.weight|{_NORMS}|{_ATTENTION}\.(weight|bias)|"
                      r"layers\.\d+\.mlp\.(gate|up|down)_proj\.weight))$"),
    linear=re.compile(rf"^(lm_head|model\.({_ATTENTION}|layers\.\d+\.mlp\.(gate|up|down)_proj))$"),
)
_MIXTRAL = Rules(
    params=re.compile(rf"^(lm_head\.weight|model\.(embed_tokens\.weight|{_NORMS}|{_ATTENTION}\.(weight|bias)|"
                      r"layers\.\d+\.mlp\.gate\.weight|layers\.\d+\.mlp\.experts\.(gate_up|down)_proj))$"),
    linear=re.compile(rf"^(lm_head|model\.{_ATTENTION})$"),
    fused=(
        (re.compile(r"^model\.layers\.(\d+)\.block_sparse_moe\.experts\.\d+\.w[13]\.weight$"),
         r"model.layers.\1.mlp.experts.gate_up_proj"),
        (re.compile(r"^model\.layers\.(\d+)\.block_sparse_moe\.experts\.\d+\.w2\.weight$"),
         r"model.layers.\1.mlp.experts.down_proj"),
        (re.compile(r"^model\.layers\.(\d+)\.block_sparse_moe\.gate\.weight$"), r"model.layers.\1.mlp.gate.weight"),
    ),
)
_GPT2 = Rules(
    params=re.compile(r"^(lm_head\.weight|transformer\.(wte|wpe|ln_f)\.(weight|bias)|"
                      r"transformer\.h\.\d+\.(ln_1|ln_2|attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)\.(weight|bias))$"),
    linear=re.compile(r"^(lm_head|transformer\.h\.\d+\.(attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj))$"),
    conv1d=True,
    prefix="transformer",
    tied_keep=("transformer.wte", "transformer.ln_f.bias"),
    tied_default=True,
)
# transformers' class (config.json's `architectures[0]`) -> its rules, for transformers 5.
KNOWN = {
    "LlamaForCausalLM": _DECODER,
    "MistralForCausalLM": _DECODER,
    "Qwen2ForCausalLM": _DECODER,
    "Qwen3ForCausalLM": _DECODER,
    "GemmaForCausalLM": replace(_DECODER, tied_default=True),
    "MixtralForCausalLM": _MIXTRAL,
    "GPT2LMHeadModel": _GPT2,
}
OUTPUT_EMBEDDING = "lm_head"  # what transformers' get_keys_to_not_convert keeps in these models, tied or not


def predict(config: dict, tensors: list[TensorRef], skip: list[str], trust_remote_code: bool = False) -> Layout | None:
    """The Layout `layout.analyze` is expected to return for this checkpoint, from names alone; None when this
    module cannot tell (then only transformers can). Shapes are not checked here: `analyze` does that."""
    if os.environ.get(ENV, "1").strip().lower() in ("0", "off", "no", "false"):
        return None
    arch = (config.get("architectures") or [None])[0]
    remote = bool(config.get("auto_map"))
    dtype = load_dtype(config, tensors)
    if dtype is None or not _transformers_5():
        return None
    family = detect_family(tensors)
    if remote:
        if not trust_remote_code or family is None or not isinstance(arch, str):
            return None  # untrusted remote code: `analyze` decides by name rules anyway, at once
        rules = _family_rules(family)
    elif arch in KNOWN and family is None:
        rules = KNOWN[arch]
    else:
        return None
    required = list(family.skip_modules) if family else []
    tied = bool(config.get("tie_word_embeddings", rules.tied_default)) and family is None
    defaults = [OUTPUT_EMBEDDING, *(rules.tied_keep if tied else ())]
    patterns = [*defaults, *required, *skip]
    decisions: dict[str, Decision] = {}
    by_skip: dict[str, str] = {}
    for t in tensors:
        key = _model_key(t.name, rules.prefix)
        fused_into = next((p.sub(target, key) for p, target in rules.fused if p.match(key)), None)
        module, _, leaf = key.rpartition(".")
        in_model = fused_into is not None or bool(rules.params.match(key))
        kept_as = cast_code(t.dtype, dtype if in_model else None)
        if fused_into is not None and not fused_into.endswith(".weight"):
            decisions[t.name] = Decision(False, f"fused by transformers into {fused_into}; bitsandbytes keeps it",
                                         dtype=kept_as, fused=True)
        elif leaf != "weight" or not rules.linear.match(module):
            decisions[t.name] = Decision(False, "not a linear weight", dtype=kept_as)
        elif len(t.shape) != 2:
            decisions[t.name] = Decision(False, f"{len(t.shape)}-D, not a 2-D linear weight", dtype=kept_as)
        elif not should_convert(module, patterns):
            which = _which_skip(module, skip, required, [])
            if which == "--skip":
                by_skip[module] = next(p for p in skip if not should_convert(module, [p]))
            decisions[t.name] = Decision(False, f"skipped ({which})", dtype=kept_as)
        else:
            decisions[t.name] = Decision(True, "Conv1D, transposed" if rules.conv1d else "nn.Linear",
                                         transpose=rules.conv1d, dtype=cast_code(t.dtype, dtype))
    skip_modules = sorted({*defaults, *required, *skip}) if skip or required else None
    method = f"transformers meta model ({arch})" + (f", {family.name} skips" if family else "")
    return Layout(decisions, skip_modules, method, warnings=unmatched_by_4x(by_skip, skip_modules or []))


def _family_rules(family: Family) -> Rules:
    """A registered family's remote code, trusted: its linear layers are the family's, plus the router and head
    (nn.Linear there, kept by the family's skip list); every checkpoint tensor is one of its parameters."""
    kept = "|".join(re.escape(m) for m in family.skip_modules)
    quantized = family.quantize.pattern.removeprefix("^").removesuffix("$")
    return Rules(params=re.compile(r"^.*$"), linear=re.compile(rf"^(?:{quantized}|(?:.*\.)?(?:{kept}))$"))


def _model_key(name: str, prefix: str) -> str:
    """The checkpoint key as the model names it: GPT-2's own checkpoints are saved without `transformer.`."""
    if not prefix or name.startswith(prefix + ".") or name.startswith("lm_head."):
        return name
    return f"{prefix}.{name}"


def _transformers_5() -> bool:
    """transformers 5 is installed (its fusing and its reasons are what the rules above say), read from its
    metadata without importing it."""
    try:
        return int(metadata.version("transformers").split(".")[0]) >= 5
    except (metadata.PackageNotFoundError, ValueError):
        return False
