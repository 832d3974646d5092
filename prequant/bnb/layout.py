"""Which tensors become 4-bit: the one place that knows architectures.

Two ways to decide, in this order:

1. transformers knows the architecture (and its code is not remote, or the user passed
   --trust-remote-code): build the model on the meta device (no memory, no weights) and apply the
   rules transformers applies on load: `nn.Linear` and GPT-2 `Conv1D` modules, minus tied weights, the
   output embedding, the last parameter, `_keep_in_fp32_modules` and the skip list. Checkpoint keys
   are mapped to model keys with transformers' own renaming tables, so keys that transformers fuses
   (native MoE experts in transformers 5) are recognised and kept, as transformers keeps them.
2. Otherwise, a registry of name rules per family (Grok-1 in both namings) and a generic fallback.

Each decision also carries the dtype transformers loads the tensor in, and with the meta model every tensor's
shape is checked against its parameter's, per-expert tensors against the fused parameter they make up (`loading`
has those rules).
"""

from __future__ import annotations

import functools
import logging
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..checkpoint.tensors import TensorRef
from ..errors import PrequantError, flag
from .loading import (Stacking, cast_code, check_fused, check_shape, fp32_pattern, load_dtype, should_convert,
                      unmatched_by_4x)

log = logging.getLogger("prequant")


@dataclass(frozen=True)
class Decision:
    """What to do with one source tensor, and why (shown in the plan)."""

    quantize: bool
    reason: str
    transpose: bool = False  # GPT-2 Conv1D stores [in, out]; bitsandbytes wants [out, in]
    dtype: str | None = None  # safetensors code transformers casts it to on load (None: loaded as stored)
    fused: bool = False  # a native MoE expert weight transformers 5 fuses into a 3-D parameter (kept, as there)
    action: str | None = None  # the plan's word for an unquantized tensor not kept as stored ("merge", "dequantize")


@dataclass(frozen=True)
class Layout:
    """The decisions for every tensor, and what config.json must say so a loader agrees."""

    decisions: dict[str, Decision]
    skip_modules: list[str] | None  # llm_int8_skip_modules to write (None keeps transformers' defaults)
    method: str  # how the decisions were made, for the plan
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)  # said on stderr by a conversion (e.g. --skip and 4.x)
    # The modules transformers keeps by default (output embedding, tied, last module): what an explicit skip list
    # written later (MoE routers, `bnb.experts`) must carry too, since it replaces transformers' defaults on load.
    default_skips: list[str] = field(default_factory=list)


def analyze(
    config: dict,
    source_dir: Path,
    tensors: list[TensorRef],
    skip: list[str],
    trust_remote_code: bool = False,
) -> Layout:
    """Decide, for each tensor, whether it is quantized and the dtype it is loaded in; see the module docstring
    for how. A tensor shaped otherwise than the model's parameter is refused (PrequantError naming it)."""
    remote = bool(config.get("auto_map"))
    dtype = load_dtype(config, tensors)
    if not remote or trust_remote_code:
        layout = _from_transformers(source_dir, tensors, skip, trust_remote_code, dtype)
        if layout is not None:
            return layout
    return _from_rules(config, tensors, skip, remote, dtype)


# --- 1. transformers on the meta device -------------------------------------------------------


def meta_model(source_dir: Path, trust_remote_code: bool, dtype: str | None) -> Any | None:
    """The model transformers builds for the checkpoint in `source_dir`, on the meta device, in `dtype` (the
    safetensors code from_pretrained loads it in; None: the config's default); None when this transformers cannot
    build it. The last build is kept, keyed by the folder, its config.json and the arguments: a merge asks for it
    twice (the layout, then transformers 5's renaming of the base's keys)."""
    try:
        config = (source_dir / "config.json").read_bytes()
    except OSError:
        config = b""
    return _built(source_dir, config, trust_remote_code, dtype)


@functools.lru_cache(maxsize=1)
def _built(source_dir: Path, config: bytes, trust_remote_code: bool, dtype: str | None) -> Any | None:
    try:
        import torch
        import transformers
        from transformers import AutoConfig, AutoModelForCausalLM

        from ..checkpoint.dtypes import SAFETENSORS_DTYPES
    except ImportError:
        return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cfg = AutoConfig.from_pretrained(source_dir, trust_remote_code=trust_remote_code)
            arch = (getattr(cfg, "architectures", None) or [None])[0]
            cls = getattr(transformers, arch, None) if arch else None
            # In the dtype from_pretrained loads it in: a kept weight is cast to its parameter's dtype.
            kwargs = {} if dtype is None else {"dtype": SAFETENSORS_DTYPES[dtype]}
            with torch.device("meta"):
                if cls is not None and hasattr(cls, "_from_config"):
                    return cls._from_config(cfg, **kwargs)
                return AutoModelForCausalLM.from_config(cfg, trust_remote_code=trust_remote_code, **kwargs)
    except Exception as e:  # an architecture this transformers does not know
        log.info("transformers cannot build this model on the meta device (%s)", e)
        return None


def _from_transformers(
    source_dir: Path, tensors: list[TensorRef], skip: list[str], trust_remote_code: bool, dtype: str | None
) -> Layout | None:
    model = meta_model(source_dir, trust_remote_code, dtype)
    if model is None:  # fall back to name rules
        return None
    from ..checkpoint.dtypes import TORCH_TO_SAFETENSORS

    defaults = _transformers_default_skips(model)
    keep_fp32 = list(getattr(model, "_keep_in_fp32_modules", None) or [])
    # A family's routers are nn.Linear in its remote code, yet must stay unquantized: they go in the skip list.
    family = detect_family(tensors)
    required = list(family.skip_modules) if family else []
    patterns = [*defaults, *required, *skip, *keep_fp32]
    linear = _linear_modules(model)
    to_model_key = _key_mapper(model)
    state = model.state_dict()  # meta tensors: every parameter's (and persistent buffer's) shape and dtype
    fp32 = fp32_pattern(model, dtype)
    name = type(model).__name__

    decisions: dict[str, Decision] = {}
    by_skip: dict[str, str] = {}  # module -> the --skip pattern keeping it
    fused: dict[str, list[tuple[TensorRef, Stacking]]] = {}  # fused parameter -> its per-expert tensors
    for t in tensors:
        model_key, converted, part = to_model_key(t.name)
        module, _, leaf = model_key.rpartition(".")
        param = state.get(model_key)
        if param is not None and not converted:
            check_shape(t, tuple(param.shape), name)
        if param is not None and part is not None:
            fused.setdefault(model_key, []).append((t, part))
        target = "F32" if fp32 is not None and fp32.search(model_key) else None
        kept_as = cast_code(t.dtype, target or (TORCH_TO_SAFETENSORS.get(param.dtype) if param is not None else None))
        if converted:
            decisions[t.name] = Decision(False, f"fused by transformers into {model_key}; bitsandbytes keeps it",
                                         dtype=kept_as, fused=True)
        elif leaf != "weight" or module not in linear:
            decisions[t.name] = Decision(False, "not a linear weight", dtype=kept_as)
        elif len(t.shape) != 2:
            decisions[t.name] = Decision(False, f"{len(t.shape)}-D, not a 2-D linear weight", dtype=kept_as)
        elif not should_convert(module, patterns):
            which = _which_skip(module, skip, required, keep_fp32)
            if which == "--skip":
                by_skip[module] = next(p for p in skip if not should_convert(module, [p]))
            decisions[t.name] = Decision(False, f"skipped: {which}", dtype=kept_as)
        else:
            conv1d = linear[module]
            decisions[t.name] = Decision(True, "Conv1D, transposed" if conv1d else "nn.Linear", transpose=conv1d,
                                         dtype=cast_code(t.dtype, target or dtype))
    for model_key, members in fused.items():
        check_fused(model_key, tuple(state[model_key].shape), members, name)
    # An explicit list replaces transformers' defaults on load, so it must carry them too.
    skip_modules = sorted({*defaults, *required, *skip}) if skip or required else None
    method = f"transformers meta model ({name})" + (f", {family.name} skips" if family else "")
    return Layout(decisions, skip_modules, method, warnings=unmatched_by_4x(by_skip, skip_modules or []),
                  default_skips=sorted(set(defaults)))


def _transformers_default_skips(model: object) -> list[str]:
    """Modules transformers leaves unquantized by default (tied weights, output embedding, last parameter)."""
    try:
        from transformers.quantizers.base import get_keys_to_not_convert

        return sorted(get_keys_to_not_convert(model))
    except Exception:
        # Same rule, computed by hand, for transformers versions that moved the helper.
        keys = {list(model.named_parameters())[-1][0].removesuffix(".weight")}  # type: ignore[attr-defined]
        out = model.get_output_embeddings()  # type: ignore[attr-defined]
        keys |= {n for n, m in model.named_modules() if out is not None and m is out}  # type: ignore[attr-defined]
        return sorted(keys)


def _linear_modules(model: object) -> dict[str, bool]:
    """name -> is_conv1d, for exactly the module types transformers replaces with 4-bit layers."""
    import torch.nn as nn

    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # pragma: no cover
        Conv1D = ()  # type: ignore[assignment]
    found: dict[str, bool] = {}
    for name, module in model.named_modules():  # type: ignore[attr-defined]
        if Conv1D and isinstance(module, Conv1D):
            found[name] = True
        elif type(module) is nn.Linear:  # subclasses are not replaced by transformers
            found[name] = False
    return found


def _key_mapper(model: object) -> Callable[[str], tuple[str, bool, Stacking | None]]:
    """checkpoint key -> (model key, converted?, how it is stacked into a fused parameter), using transformers' own
    loading-time renaming. The last is None for a key not fused, or fused by a converter other than the experts'
    stack (whose per-tensor shapes are not derived here)."""
    params = dict.fromkeys(k for k, _ in model.named_parameters())  # type: ignore[attr-defined]
    prefix = getattr(model, "base_model_prefix", None)
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

        transforms = get_model_conversion_mapping(model)
        renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        converters = [t for t in transforms if isinstance(t, WeightConverter)]
        stacks = _stacks(converters)

        def mapped(key: str) -> tuple[str, bool, Stacking | None]:
            new, pattern = rename_source_key(key, renamings, converters, prefix, params)
            return new, pattern is not None, None if pattern is None else stacks.get(pattern)

        return mapped
    except Exception:
        # Older transformers: no renaming tables; only the base-model prefix may differ.
        def plain(key: str) -> tuple[str, bool, Stacking | None]:
            if key in params or not prefix:
                return key, False, None
            if f"{prefix}.{key}" in params:
                return f"{prefix}.{key}", False, None
            return key.removeprefix(f"{prefix}."), False, None

        return plain


def _stacks(converters: list) -> dict[str, Stacking | None]:
    """Each converter source pattern's `Stacking`; none where transformers' converters no longer read as
    `_stacking` expects (then the fused shapes go unchecked, and every renaming still applies)."""
    try:
        return {pattern: _stacking(c, i) for c in converters for i, pattern in enumerate(c.source_patterns)}
    except Exception:  # noqa: BLE001 - an attribute or class of transformers' converters changed
        return {}


def _stacking(converter: object, part: int) -> Stacking | None:
    """How the converter of native MoE experts fuses the tensors of its source pattern `part` (each pattern's
    tensors stacked along a new dimension 0, the patterns then concatenated along one dimension: `MergeModulelist(0)`,
    then `Concatenate`); None for any other converter."""
    from transformers.core_model_loading import Concatenate, MergeModulelist

    ops = list(converter.operations)  # type: ignore[attr-defined]
    patterns = tuple(converter.source_patterns)  # type: ignore[attr-defined]
    if not ops or type(ops[0]) is not MergeModulelist or ops[0].dim != 0 or "*" not in patterns[part]:
        return None
    if len(ops) == 1 and len(patterns) == 1:
        return Stacking(part, None, patterns)
    if len(ops) == 2 and type(ops[1]) is Concatenate and ops[1].dim >= 1:
        # In the stacked tensor, dimension d is each expert's dimension d - 1.
        return Stacking(part, ops[1].dim - 1, patterns)
    return None


def _which_skip(module: str, skip: list[str], required: list[str], keep_fp32: list[str]) -> str:
    if not should_convert(module, skip):
        return "--skip"
    if not should_convert(module, required):
        return "router/head kept for this family"
    if not should_convert(module, keep_fp32):
        return "_keep_in_fp32_modules"
    return "output embedding / tied / last module"


# --- 2. name rules ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Family:
    """Name rules for a family transformers cannot build here (remote code, or no transformers)."""

    name: str
    detect: re.Pattern[str]  # matches some tensor name only this family has
    quantize: re.Pattern[str]  # module names (without .weight) that are linear layers to quantize
    skip_modules: tuple[str, ...]  # linear modules to keep, written to llm_int8_skip_modules


FAMILIES: tuple[Family, ...] = (
    Family(
        "grok-1 (keyfan naming)",
        re.compile(r"^transformer\.decoder_layer\.\d+\.moe\.\d+\.linear"),
        re.compile(
            r"^transformer\.decoder_layer\.\d+\."
            r"(multi_head_attention\.(query|key|value|linear)|moe\.\d+\.(linear|linear_v|linear_1))$"
        ),
        ("lm_head", "router"),
    ),
    Family(
        "grok-1 (hpcai-tech naming)",
        re.compile(r"^model\.layers\.\d+\.moe_block\.experts\.\d+\.linear"),
        re.compile(r"^model\.layers\.\d+\.(attn\.[qkvo]_proj|moe_block\.experts\.\d+\.(linear|linear_v|linear_1))$"),
        ("lm_head", "moe_block.gate"),
    ),
)

# Generic fallback: a 2-D `*.weight` is a linear layer unless its name says embedding, norm, head or router.
_NOT_LINEAR = re.compile(
    r"(^|\.)(lm_head|embed\w*|wte|wpe|in_out_embed|\w*norm\w*|ln_\w+|router|gate|score|classifier)$"
)


def detect_family(tensors: list[TensorRef]) -> Family | None:
    """The registered family whose tell-tale tensor names the checkpoint has, if any."""
    return next((f for f in FAMILIES if any(f.detect.match(t.name) for t in tensors)), None)


def _from_rules(config: dict, tensors: list[TensorRef], skip: list[str], remote: bool, dtype: str | None) -> Layout:
    family = detect_family(tensors)
    decisions: dict[str, Decision] = {}
    by_skip: dict[str, str] = {}
    for t in tensors:
        module, _, leaf = t.name.rpartition(".")
        cast = cast_code(t.dtype, dtype)  # no model to ask: every floating-point tensor in the model's dtype
        if leaf != "weight" or len(t.shape) != 2:
            decisions[t.name] = Decision(False, "not a 2-D weight", dtype=cast)
        elif not should_convert(module, skip):
            by_skip[module] = next(p for p in skip if not should_convert(module, [p]))
            decisions[t.name] = Decision(False, "skipped: --skip", dtype=cast)
        elif family is not None:
            linear = bool(family.quantize.match(module))
            decisions[t.name] = Decision(linear, f"{family.name} rule" if linear else f"kept by {family.name} rule",
                                         dtype=cast)
        elif _NOT_LINEAR.search(module):
            decisions[t.name] = Decision(False, "embedding/norm/head/router by name", dtype=cast)
        else:
            decisions[t.name] = Decision(True, "2-D weight (generic rule)", dtype=cast)
    required = family.skip_modules if family else ("lm_head",)
    notes = []
    if remote:
        notes.append("remote code present and not trusted: decided by name rules, no checkpoint code was run")
    if family is None:
        notes.append("architecture unknown to transformers here: generic name rules used; check the plan")
    method = f"name rules ({family.name})" if family else "name rules (generic)"
    skip_modules = sorted({*required, *skip})
    return Layout(decisions, skip_modules, method, notes, unmatched_by_4x(by_skip, skip_modules))


def require_known(layout: Layout) -> None:
    """Refuse a plan that would quantize nothing: almost surely a wrong source or rules."""
    if not any(d.quantize for d in layout.decisions.values()):
        raise PrequantError(
            f"no tensor would be quantized (no linear weights found); check the source, or {flag('skip', None)} "
            "patterns"
        )
