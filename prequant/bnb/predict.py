"""The layout transformers will decide, predicted from tensor names alone, for architectures whose rules are known.

`layout.analyze` asks transformers (a model built on the meta device), which costs its modeling imports: seconds
of one core before anything can be planned. For the common architectures the answer follows from the names:
which modules are `nn.Linear` (or GPT-2's `Conv1D`), that the output embedding stays unquantized, which MoE
experts transformers 5 fuses. `predict` returns that Layout, in exactly the form `analyze` gives it (same
reasons, dtypes, method and skip list), so that a settled one stands for it. None where the rules are
not known here (another architecture, transformers 4, remote code not trusted, a `_keep_in_fp32` model...).

`settled` says when the prediction is transformers' answer rather than a guess: the architecture is one of
`KNOWN` (no remote code), the installed transformers is one of the `VERIFIED` versions, and the checkpoint holds
exactly the parameters that model holds, in the shapes it requires (`params.expected`, from config.json). Then
no conversion, dry run or resume imports transformers' modeling code (seconds) to decide anything (`decide`).
Anything else (a newer transformers, an extra or missing tensor, a shape transformers would refuse, a config this
module cannot read) is decided by transformers (`layout.analyze`) before anything is planned.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from importlib import metadata
from pathlib import Path

from ..checkpoint.tensors import TensorRef
from .layout import Decision, Family, Layout, _which_skip, analyze, detect_family
from .loading import cast_code, load_dtype, should_convert, unmatched_by_4x
from .params import expected

# transformers (major, minor) versions whose layout the prediction is, for a checkpoint `settled` accepts.
# `python scripts/dev/check_layout_rules.py VERSION...` runs tests/bnb/test_predict.py and test_params.py (each
# architecture's models built, saved and decided by that transformers) with each version. 5.0 differs (with tied
# embeddings and --skip, its skip list lacks the last module), so there transformers decides. Raise the upper end
# only after that script passes on the new version.
VERIFIED = ((5, 1), (5, 25))


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
_QWEN3_MOE = Rules(  # routed experts in the layers `params` finds sparse, dense MLPs in the others
    params=re.compile(rf"^(lm_head\.weight|model\.(embed_tokens\.weight|{_NORMS}|{_ATTENTION}\.(weight|bias)|"
                      r"layers\.\d+\.mlp\.((gate|up|down)_proj|gate)\.weight|"
                      r"layers\.\d+\.mlp\.experts\.(gate_up|down)_proj))$"),
    linear=_DECODER.linear,
    fused=(
        (re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.\d+\.(gate|up)_proj\.weight$"),
         r"model.layers.\1.mlp.experts.gate_up_proj"),
        (re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.\d+\.down_proj\.weight$"),
         r"model.layers.\1.mlp.experts.down_proj"),
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
    "Qwen3MoeForCausalLM": _QWEN3_MOE,
    "GPT2LMHeadModel": _GPT2,
}
MODEL_TYPES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
               "Qwen3ForCausalLM": "qwen3", "GemmaForCausalLM": "gemma", "MixtralForCausalLM": "mixtral",
               "Qwen3MoeForCausalLM": "qwen3_moe",
               "GPT2LMHeadModel": "gpt2"}  # config.json's model_type for each (its config class)
OUTPUT_EMBEDDING = "lm_head"  # what transformers' get_keys_to_not_convert keeps in these models, tied or not


def predict(config: dict, tensors: list[TensorRef], skip: list[str], trust_remote_code: bool = False) -> Layout | None:
    """The Layout `layout.analyze` is expected to return for this checkpoint, from names alone; None when this
    module cannot tell (then only transformers can). Shapes are not checked here: `analyze` does that."""
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
    tied = _tied(config, rules) and family is None
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
            decisions[t.name] = Decision(False, f"skipped: {which}", dtype=kept_as)
        else:
            decisions[t.name] = Decision(True, "Conv1D, transposed" if rules.conv1d else "nn.Linear",
                                         transpose=rules.conv1d, dtype=cast_code(t.dtype, dtype))
    skip_modules = sorted({*defaults, *required, *skip}) if skip or required else None
    method = f"transformers meta model ({arch})" + (f", {family.name} skips" if family else "")
    return Layout(decisions, skip_modules, method, warnings=unmatched_by_4x(by_skip, skip_modules or []),
                  default_skips=sorted(set(defaults)))


def decide(config: dict, source_dir: Path, tensors: list[TensorRef], skip: list[str],
           trust_remote_code: bool = False) -> tuple[Layout, bool]:
    """The layout transformers decides for this checkpoint, and whether it was `settled` from names alone (then
    transformers' modeling code is not imported); else transformers' own (`layout.analyze`), asked here."""
    if settled(config, tensors):
        layout = predict(config, tensors, skip, trust_remote_code)
        assert layout is not None  # settled implies a prediction
        return layout, True
    return analyze(config, source_dir, tensors, skip, trust_remote_code), False


def settled(config: dict, tensors: list[TensorRef], transformers_version: str | None = None) -> bool:
    """Whether `predict`'s layout for this checkpoint is transformers' own, without asking it: see the module
    docstring. `transformers_version`: the installed one's unless given."""
    if not _may_settle(config, transformers_version) or detect_family(tensors) is not None:
        return False
    arch = config["architectures"][0]
    if load_dtype(config, tensors) is None or (shapes := expected(arch, config)) is None:
        return False
    rules = KNOWN[arch]
    if _tied(config, rules):
        shapes.pop("lm_head.weight")  # transformers saves a tied head as the embedding alone; both are not assumed
    found = {_model_key(t.name, rules.prefix): tuple(t.shape) for t in tensors}
    return len(found) == len(tensors) and found == shapes


def _may_settle(config: dict, transformers_version: str | None = None) -> bool:
    """What `settled` asks of config.json and the environment alone (no tensor is read): a known architecture
    without remote code (even trusted, remote code is its own: what it builds is never assumed), a verified
    transformers."""
    if not verified(transformers_version):
        return False
    arch = (config.get("architectures") or [None])[0]
    if config.get("auto_map") or arch not in KNOWN or "quantization_config" in config:
        return False
    # transformers picks the config class by model_type: another than the architecture's would bring other
    # defaults (e.g. num_key_value_heads) than the ones `params` assumes.
    return config.get("model_type") == MODEL_TYPES[arch]


def verified(transformers_version: str | None = None) -> bool:
    """Whether this transformers (the installed one unless given) is one of the VERIFIED versions."""
    version = transformers_version or _installed_transformers()
    return version is not None and VERIFIED[0] <= _minor(version) <= VERIFIED[1]


def _tied(config: dict, rules: Rules) -> bool:
    """Whether the model ties its output embedding to the input one (config.json, else its class' default)."""
    return bool(config.get("tie_word_embeddings", rules.tied_default))


def _minor(version: str) -> tuple[int, int]:
    parts = re.match(r"(\d+)\.(\d+)", version)
    return (int(parts[1]), int(parts[2])) if parts else (0, 0)


def _installed_transformers() -> str | None:
    try:
        return metadata.version("transformers")
    except metadata.PackageNotFoundError:
        return None


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
    version = _installed_transformers()
    return version is not None and _minor(version) >= (5, 0)
