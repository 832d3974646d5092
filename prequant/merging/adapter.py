"""A peft LoRA adapter, read for merging: its config, and for each base tensor it changes, the adapter tensors
that change it (by reference: nothing is read until the pipeline reaches that tensor).

peft saves an adapter as adapter_config.json + adapter_model.safetensors (or .bin), its keys under
`base_model.model.` followed by the module's name in the model peft wrapped:

    <module>.lora_A.weight, <module>.lora_B.weight     a Linear (or GPT-2 Conv1D) target
    <module>.lora_embedding_A, <module>.lora_embedding_B   an Embedding target
    <module>.lora_magnitude_vector                     DoRA's magnitude of that target
    <module>.base_layer.weight                         the embedding itself (save_embedding_layers)
    <module>.weight, <module>.bias, ...                modules_to_save: whole tensors that replace the base's
    <experts>[.base_layer].lora_A.weight, ...lora_B.weight   LoRA on a fused experts parameter (target_parameters)
    <module>.lora_A.weight, <module>.lora_B.weight     LoRA on a module's bare 2-D `weight` (target_parameters:
                                                       a router, say): merged as a Linear's

The module names are those of the model the adapter was trained on: transformers 4 names them as the checkpoint
does, transformers 5 (and `load_for_fsdp` for MoE experts) may rename them on load (`base_names` maps them back).

LoRA on transformers 5's fused experts (peft's `ParamWrapper`: what peft makes of gate/up/down targets on a fused
MoE model, and what `load_for_fsdp` gives experts kept 16-bit) holds every expert in one A and one B: for the
parameter `gate_up_proj [E, 2I, H]` (each expert's gate rows, then its up rows) or `down_proj [E, H, I]`, A is
[E * r, in] (expert e's rows e*r .. e*r + r-1) and B is [out, r * E] (expert e's columns e, e + E, e + 2E, ...).
Expert e's delta is B_e @ A_e, which goes to the checkpoint's own per-expert tensors: its gate rows to
`<experts>.<e>.gate_proj.weight` (Mixtral's w1), its up rows to `up_proj` (w3), down_proj's to `down_proj` (w2).
peft wraps a module's targeted parameters one around the other in the order the module registers them
(gate_up_proj, then down_proj), so the outermost, the last one, has the module's own keys and each one inside it
one more `.base_layer`. The rank and alpha are those of `<experts>.<parameter>` in rank_pattern/alpha_pattern.
Anything else (another peft type or LoRA variant, a LoRA bias, a key no base tensor matches) is refused, naming it;
so is what peft itself refuses when it loads the adapter: a config value of the wrong type or range, a tensor whose
shape does not fit its target, an adapter that changes nothing. `fan_in_fan_out` is what peft makes of it: true for
a GPT-2 Conv1D, false for anything else, whatever the config says.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..bnb.experts import ROLES, expert_match
from ..bnb.layout import meta_model
from ..checkpoint.reader import scan_files
from ..checkpoint.tensors import TensorRef, quote
from ..errors import PrequantError
from .folder import CONFIG_NAME, WEIGHT_NAMES

PREFIX = "base_model.model."
_LORA_PARTS = {"lora_A.weight": "a", "lora_B.weight": "b", "lora_embedding_A": "a", "lora_embedding_B": "b",
               "lora_magnitude_vector": "magnitude", "base_layer.weight": "base"}
_UNSUPPORTED_PARTS = ("lora_B.bias", "lora_A.bias", "lora_embedding_A.weight", "lora_embedding_B.weight")
# adapter_config.json keys that, set, make peft merge otherwise than W + (B @ A) * scaling (its LoRA variants other
# than DoRA, and features whose tensors are not LoRA's)
_VARIANTS = ("alora_invocation_tokens", "arrow_config", "kasa_config", "monteclora_config", "trainable_token_indices",
             "use_bdlora", "use_qalora", "velora_config")
# transformers 5's fused experts parameters, in the order the experts module registers them, and the expert
# projections (ROLES) each one holds, its rows in that order
FUSED = {"gate_up_proj": ("gate", "up"), "down_proj": ("down",)}


@dataclass
class Target:
    """What the adapter does to one base tensor (`key`, in the base checkpoint's naming)."""

    key: str
    module: str  # the module as the adapter names it (peft's patterns match this name)
    a: TensorRef | None = None
    b: TensorRef | None = None
    magnitude: TensorRef | None = None  # DoRA
    base: TensorRef | None = None  # a saved embedding layer: the W peft loads before merging
    replace: TensorRef | None = None  # modules_to_save: the whole tensor
    scaling: float = 0.0
    embedding: bool = False  # delta = (B @ A).T
    fan_in_fan_out: bool = False  # W stored [in, out] (GPT-2 Conv1D)
    expert: tuple[int, int] | None = None  # (e, E): A and B hold E experts' LoRA on a fused parameter; e's is W's
    rows: slice | None = None  # with `expert`: the rows of the fused parameter (of B) that are W

    @property
    def lora(self) -> bool:
        return self.a is not None


@dataclass(frozen=True)
class Adapter:
    """An adapter's config and tensors, as found in `directory`."""

    directory: Path
    config: dict
    files: tuple[Path, ...]
    tensors: dict[str, TensorRef]  # by key, without the `base_model.model.` prefix
    identity: dict = field(default_factory=dict)  # spec, repo and commit (a Hub adapter); files' sha256 added by run

    @property
    def base_model(self) -> str | None:
        return self.config.get("base_model_name_or_path")


def read(directory: Path, identity: dict) -> Adapter:
    """The adapter in `directory`: its config checked (LoRA only) and its tensors' headers read."""
    path = directory / CONFIG_NAME
    if not path.is_file():
        raise PrequantError(f"no {CONFIG_NAME}; pass the folder peft's save_pretrained wrote", where=directory)
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise PrequantError(f"not valid JSON ({e}); save the adapter again", where=path) from e
    if not isinstance(config, dict):
        raise PrequantError("not a JSON object; save the adapter again", where=path)
    kind = config.get("peft_type", "LORA")
    if kind != "LORA":
        raise PrequantError(f"peft_type {kind!r} is not LoRA: prequant merges LoRA adapters (DoRA and rsLoRA "
                            "included) only; merge it with peft's merge_and_unload", where=path)
    _check_config(config, path)
    for name in config.get("target_parameters") or []:
        if name.rpartition(".")[2] not in (*FUSED, "weight"):
            raise PrequantError(f"target_parameters entry {name!r} is neither a fused experts parameter "
                                f"({' or '.join(FUSED)}) nor a 2-D weight, the bare parameters prequant merges LoRA "
                                "into; merge it with peft", where=path)
    if config.get("lora_bias"):
        raise PrequantError("lora_bias is true: merging LoRA biases is not supported; merge it with peft", where=path)
    files = tuple(directory / n for n in WEIGHT_NAMES if (directory / n).is_file())[:1]
    if not files:
        raise PrequantError(f"no {' or '.join(WEIGHT_NAMES)}; pass the folder peft's save_pretrained wrote",
                            where=directory)
    tensors = {}
    for ref in scan_files(files):
        if not ref.name.startswith(PREFIX):
            raise PrequantError(f"adapter key {quote(ref.name)} does not start with {PREFIX!r}: not a peft adapter "
                                "file", where=files[0])
        tensors[ref.name.removeprefix(PREFIX)] = ref
    return Adapter(directory, config, files, tensors, identity)


def _check_config(config: dict, path: Path) -> None:
    """The values of adapter_config.json that the merge uses, of the types and in the ranges peft requires: one
    line naming the key, else a value peft would refuse (or read otherwise than it was meant) reaches the merge."""
    def refuse(key: str, value: object, wanted: str) -> PrequantError:
        return PrequantError(f"{key} is {json.dumps(value)[:80]}, not {wanted}; set it to the value the adapter was "
                             "trained with, or save the adapter again with peft", where=path)

    def number(value: object) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)

    def rank(value: object) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value > 0

    for key in _VARIANTS:
        if config.get(key):
            raise PrequantError(f"{key!r} is set: a LoRA variant or feature whose merge prequant does not implement "
                                "(it merges LoRA, rsLoRA and DoRA); merge this adapter with peft's merge_and_unload",
                                where=path)
    if isinstance(config.get("init_lora_weights"), str) and config["init_lora_weights"].startswith("mica"):
        raise PrequantError("'init_lora_weights' is 'mica': MiCA is a LoRA variant whose merge prequant does not "
                            "implement; merge this adapter with peft's merge_and_unload", where=path)
    if config.get("layer_replication"):
        raise PrequantError("'layer_replication' is set: the trained model repeats base layers, which no merge into "
                            "the base can hold (peft refuses it too); keep the adapter unmerged", where=path)
    if not rank(config.get("r", 8)):
        raise refuse("'r'", config.get("r"), "a positive integer (LoRA's rank)")
    if not number(config.get("lora_alpha", 8)):
        raise refuse("'lora_alpha'", config.get("lora_alpha"), "a number")
    for key in ("use_rslora", "use_dora", "fan_in_fan_out", "lora_bias"):
        if config.get(key) is not None and not isinstance(config[key], bool):
            raise refuse(repr(key), config[key], "true or false")
    names = config.get("target_parameters")
    if names is not None and not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
        raise refuse("'target_parameters'", names, "a list of parameter names")
    for key, valid, wanted in (("rank_pattern", rank, "a positive integer"), ("alpha_pattern", number, "a number")):
        patterns = config.get(key)
        if patterns is None:
            continue
        if not isinstance(patterns, dict):
            raise refuse(repr(key), patterns, "an object of {pattern: value}")
        for pattern, value in patterns.items():
            try:
                re.compile(pattern)
            except re.error as e:
                raise PrequantError(f"{key!r} pattern {pattern!r} is not a regular expression ({e}); peft matches "
                                    "module names with it: correct it, or save the adapter again with peft",
                                    where=path) from e
            if not valid(value):
                raise refuse(f"{key!r} of {pattern!r}", value, wanted)


def wanted(adapter: Adapter) -> list[str]:
    """The base tensors the adapter's keys name, as the trained model named them; for LoRA on fused experts, the
    experts module (never a tensor's key: its per-expert tensors are found under both namings)."""
    out = []
    for key in adapter.tensors:
        module, part = _split(key)
        on = _parameter(adapter.config, module, key) if part is not None else None
        out.append(on[0] if on and on[1] in FUSED else key if part is None else f"{module}.weight")
    return out


def targets(adapter: Adapter, base_keys: dict[str, str], shapes: dict[str, tuple[int, ...]],
            conv1d: set[str]) -> dict[str, Target]:
    """Each base tensor the adapter changes (by its key in the base checkpoint) and how, checked as peft checks the
    adapter when it loads it. `base_keys` maps a tensor's name in the trained model to its key in the base
    checkpoint (`base_names`); `shapes` gives each base tensor's shape as the merge sees it (a 4-bit weight's
    dequantized, a GPT-2 Conv1D's [in, out]); `conv1d` the weights of GPT-2 Conv1D layers, the only ones peft
    merges transposed (fan_in_fan_out), whatever the config says. Every adapter key must find its base tensor,
    every tensor must fit it, and the adapter must change something; anything else is refused, naming it."""
    cfg = adapter.config
    found: dict[str, Target] = {}
    on_fused: dict[tuple[str, str], dict[str, TensorRef]] = {}
    for key, ref in adapter.tensors.items():
        module, part = _split(key)
        on = _parameter(cfg, module, key) if part is not None else None
        if on is not None and part not in ("lora_A.weight", "lora_B.weight"):
            raise PrequantError(f"adapter key {quote(PREFIX + key)} ({part}) is not supported on a bare parameter "
                                "(target_parameters); merge this adapter with peft", where=adapter.files[0])
        if on is not None and on[1] in FUSED:
            on_fused.setdefault(on, {})[_LORA_PARTS[part]] = ref
            continue
        if part is None:  # modules_to_save: a whole tensor under the module's own name
            base = _base_key(key, base_keys, adapter)
            target = found.setdefault(base, Target(base, module))
            target.replace = ref
            continue
        base = _base_key(f"{module}.weight", base_keys, adapter, shown=key)
        # LoRA on a bare 2-D weight (a router, say) is a Linear's; peft's patterns match the parameter's name
        target = found.setdefault(base, Target(base, module if on is None else f"{module}.weight"))
        setattr(target, _LORA_PARTS[part], ref)
        target.embedding = target.embedding or part.startswith("lora_embedding")
    for target in found.values():
        if target.replace is not None and (target.lora or target.base or target.magnitude):
            raise PrequantError(f"{quote(target.key)} is both in modules_to_save and a LoRA target; save the "
                                "adapter again with peft", where=adapter.files[0])
        if target.replace is not None:
            _fits(target.replace, shapes[target.key], target.key, adapter)
            continue
        if target.a is None or target.b is None:
            raise PrequantError(f"module {quote(target.module)} has {'lora_B' if target.a is None else 'lora_A'} but "
                                f"not {'lora_A' if target.a is None else 'lora_B'}; the adapter is incomplete: save "
                                "it again", where=adapter.files[0])
        if target.embedding and (target.magnitude is not None or cfg.get("use_dora")):
            raise PrequantError(f"module {quote(target.module)}: DoRA on an embedding is not supported; merge it "
                                "with peft", where=adapter.files[0])
        # peft decides from the layer's class: a Conv1D always merges transposed, an nn.Linear never does
        target.fan_in_fan_out = target.key in conv1d and not target.embedding
        _check_shapes(target, shapes[target.key], adapter)
        if target.magnitude is not None and not cfg.get("use_dora"):
            raise PrequantError(f"adapter tensor {quote(target.magnitude.name)} is a DoRA magnitude, but {CONFIG_NAME} "
                                "says use_dora is false: peft would ignore it and merge plain LoRA; set use_dora to "
                                "true if the adapter was trained with DoRA", where=adapter.files[0])
        if target.magnitude is None and cfg.get("use_dora"):
            raise PrequantError(f"module {quote(target.module)} has no lora_magnitude_vector, but {CONFIG_NAME} says "
                                "use_dora is true; the adapter is incomplete: save it again with peft",
                                where=adapter.files[0])
        r = target.a.shape[0]
        rank, alpha = _pattern(cfg, "rank_pattern", target.module, cfg.get("r", 8)), \
            _pattern(cfg, "alpha_pattern", target.module, cfg.get("lora_alpha", 8))
        if rank != r:
            raise PrequantError(f"module {quote(target.module)} has rank {r} in its tensors but {rank} in "
                                f"{CONFIG_NAME}; the adapter's config does not match its weights: set r (or its "
                                "rank_pattern) to the rank it was trained with", where=adapter.files[0])
        target.scaling = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    for (experts, param), lora in on_fused.items():
        for target in _expert_targets(adapter, experts, param, lora, base_keys, shapes):
            if target.key in found:
                raise PrequantError(f"{quote(target.key)} has LoRA both of its own and on {quote(target.module)}; "
                                    "save the adapter again with peft", where=adapter.files[0])
            found[target.key] = target
    if not found:
        named = cfg.get("target_modules") or cfg.get("target_parameters")
        raise PrequantError("the adapter changes no tensor of the base: its weights hold no LoRA tensor"
                            f"{f' (target_modules {json.dumps(named)[:120]})' if named else ''}, and peft refuses "
                            "such an adapter; pass the adapter saved after training on this base",
                            where=adapter.files[0])
    return found


_MISFIT = ("; the adapter was trained on another model (or a resized vocabulary), or is damaged: check the base, or "
           "save the adapter again with peft")


def _fits(ref: TensorRef, shape: tuple[int, ...], key: str, adapter: Adapter) -> None:
    """A tensor that replaces the base's `key` whole (modules_to_save, a saved embedding layer) has its shape."""
    if tuple(ref.shape) != tuple(shape):
        raise PrequantError(f"adapter tensor {quote(ref.name)} has shape {tuple(ref.shape)}, but the base tensor "
                            f"{quote(key)} it replaces is {tuple(shape)}{_MISFIT}", where=adapter.files[0])


def _check_shapes(target: Target, shape: tuple[int, ...], adapter: Adapter) -> None:
    """The LoRA of `target` against its base tensor (`shape`, as merged), as peft's load checks it (size mismatch):
    A [r, in] and B [out, r] with r > 0, (out, in) W's shape, transposed for an embedding (A [r, vocab]) and for a
    GPT-2 Conv1D (W stored [in, out]); DoRA's magnitude [out]; a saved embedding layer W's own shape."""
    a, b, shape = target.a, target.b, tuple(shape)
    assert a is not None and b is not None
    where = adapter.files[0]
    if len(shape) != 2:
        raise PrequantError(f"adapter tensor {quote(a.name)} is LoRA on {quote(target.key)}, which is "
                            f"{len(shape)}-D {shape}, not a 2-D weight{_MISFIT}", where=where)
    for ref in (a, b):
        if len(ref.shape) != 2:
            raise PrequantError(f"adapter tensor {quote(ref.name)} has shape {tuple(ref.shape)}, not 2-D; the "
                                "adapter is damaged: save it again with peft", where=where)
    r = a.shape[0]  # rank 0 is refused by the check against the config's rank, which is positive
    if b.shape[1] != r:
        raise PrequantError(f"adapter tensor {quote(b.name)} has shape {tuple(b.shape)}, rank {b.shape[1]}, but its "
                            f"lora_A {quote(a.name)} has rank {r} {tuple(a.shape)}; the adapter is damaged: save it "
                            "again with peft", where=where)
    out, inp = shape[::-1] if target.embedding or target.fan_in_fan_out else shape
    for ref, wanted in ((b, (out, r)), (a, (r, inp))):
        if tuple(ref.shape) != wanted:
            raise PrequantError(f"adapter tensor {quote(ref.name)} has shape {tuple(ref.shape)}, but its target "
                                f"{quote(target.key)} of shape {shape} needs {wanted}{_MISFIT}", where=where)
    m = target.magnitude
    if m is not None and tuple(m.shape) != (out,):
        raise PrequantError(f"adapter tensor {quote(m.name)} has shape {tuple(m.shape)}, but DoRA's magnitude of "
                            f"{quote(target.key)} (shape {shape}) holds one value per output: {(out,)}{_MISFIT}",
                            where=where)
    if target.base is not None:
        _fits(target.base, shape, target.key, adapter)


def _parameter(cfg: dict, module: str, key: str) -> tuple[str, str] | None:
    """(module, parameter) when the LoRA of adapter module `module` (`key`'s) is on a bare parameter that
    target_parameters names (a fused experts parameter, or a module's 2-D `weight`), else None."""
    names = cfg.get("target_parameters") or []
    if not names:
        return None
    owner, depth = module, 0
    while owner.endswith(".base_layer"):
        owner, depth = owner.removesuffix(".base_layer"), depth + 1
    params = tuple(FUSED) if owner.rpartition(".")[2] == "experts" else ("weight",)
    # peft's match of a parameter to target_parameters: the full name, or a suffix of it from a dot
    hit = [p for p in params if any(f"{owner}.{p}" == n or f"{owner}.{p}".endswith(f".{n}") for n in names)]
    if not hit:
        return None
    if depth >= len(hit):
        raise PrequantError(f"adapter key {quote(PREFIX + key)} is the LoRA of no parameter of {quote(owner)} that "
                            "target_parameters names; the adapter's config does not match its weights")
    return owner, hit[len(hit) - 1 - depth]


def _expert_targets(adapter: Adapter, experts: str, param: str, lora: dict[str, TensorRef],
                    base_keys: dict[str, str], shapes: dict[str, tuple[int, ...]]) -> list[Target]:
    """One Target per per-expert base tensor that the LoRA `lora` (its A and B) on `experts`' fused `param`
    changes."""
    shown = f"{experts}.{param}"
    where = adapter.files[0]
    if set(lora) != {"a", "b"}:
        raise PrequantError(f"the LoRA of {quote(shown)} has {'lora_A' if 'a' in lora else 'lora_B'} but not "
                            f"{'lora_B' if 'a' in lora else 'lora_A'}; the adapter is incomplete: save it again",
                            where=where)
    roles: dict[str, dict[int, str]] = {role: {} for role in FUSED[param]}
    for name, key in base_keys.items():
        m = expert_match(name)
        if m is not None and f"{m['block']}.experts" == experts and ROLES[m["proj"]] in roles:
            roles[ROLES[m["proj"]]][int(m["index"])] = key
    count = len(roles[FUSED[param][0]])
    if count == 0 or any(sorted(found) != list(range(count)) for found in roles.values()):
        raise PrequantError(f"adapter LoRA on {quote(shown)} matches no complete set of per-expert tensors "
                            f"({', '.join(f'{experts}.N.<{r}>.weight' for r in roles)}) in the base; check that the "
                            "adapter was trained on this base", where=where)
    a, b, cfg = lora["a"], lora["b"], adapter.config
    rank = _pattern(cfg, "rank_pattern", shown, cfg.get("r", 8))
    alpha = _pattern(cfg, "alpha_pattern", shown, cfg.get("lora_alpha", 8))
    if len(a.shape) != 2 or len(b.shape) != 2 or a.shape[0] != rank * count or b.shape[1] != rank * count \
            or b.shape[0] % len(roles):
        raise PrequantError(f"the LoRA of {quote(shown)} has A {tuple(a.shape)} and B {tuple(b.shape)}, not rank "
                            f"{rank} ({CONFIG_NAME}) on {count} experts; the adapter's config does not match its "
                            "weights or base", where=where)
    scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    rows = b.shape[0] // len(roles)
    for key in (key for found in roles.values() for key in found.values()):
        if tuple(shapes[key]) != (rows, a.shape[1]):
            raise PrequantError(f"the LoRA of {quote(shown)} has A {tuple(a.shape)} and B {tuple(b.shape)}: each "
                                f"expert's delta is {(rows, a.shape[1])}, but the base's {quote(key)} is "
                                f"{tuple(shapes[key])}{_MISFIT}", where=where)
    return [Target(key, shown, a=a, b=b, scaling=scaling, expert=(e, count), rows=slice(i * rows, (i + 1) * rows))
            for i, role in enumerate(roles) for e, key in sorted(roles[role].items())]


def _split(key: str) -> tuple[str, str | None]:
    """(module, LoRA part) of an adapter key; part None for a modules_to_save tensor."""
    for part in _UNSUPPORTED_PARTS:
        if key.endswith("." + part):
            raise PrequantError(f"adapter key {quote(PREFIX + key)} ({part}) is not supported; merge this adapter "
                                "with peft")
    for part in _LORA_PARTS:
        if key.endswith("." + part):
            return key[: -len(part) - 1], part
    if re.search(r"\.(lora_|hada_|lokr_|vera_|ia3_|oft_|boft_)", key):
        raise PrequantError(f"adapter key {quote(PREFIX + key)} is not one prequant merges (LoRA A/B, DoRA magnitude, "
                            "modules_to_save); merge this adapter with peft")
    return key.rpartition(".")[0], None


def _base_key(name: str, base_keys: dict[str, str], adapter: Adapter, shown: str | None = None) -> str:
    if name in base_keys:
        return base_keys[name]
    raise PrequantError(f"adapter key {quote(PREFIX + (shown or name))} matches no tensor of the base model "
                        f"({quote(name)} is not in it); check that the adapter was trained on this base",
                        where=adapter.files[0])


def _pattern(cfg: dict, which: str, module: str, default: float) -> float:
    """peft's rank_pattern/alpha_pattern lookup: the first pattern that matches the module's name from a dot
    boundary to its end."""
    for pattern, value in (cfg.get(which) or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            return value
    return default


def base_names(keys: list[str], config_dir: Path, wanted: list[str], trust_remote_code: bool,
               dtype: str | None = None) -> dict[str, str]:
    """{a tensor's name in the trained model: its key in the base checkpoint}. Names are the checkpoint's own
    (transformers 4, and models transformers 5 does not rename); when one of `wanted` is not among `keys`, the
    checkpoint's keys are also renamed as transformers 5 renames them on load (its renaming tables, on the model
    built on the meta device: `layout.meta_model`, the one the layout was decided on when `dtype` is the same),
    so adapters trained on either match. A base's own code (auto_map) runs only with `trust_remote_code`; without
    it, transformers is told so and never asks."""
    names = {k: k for k in keys}
    if all(w in names for w in wanted):
        return names
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, rename_source_key
    except ImportError:  # no transformers 5: the checkpoint's names are the only ones
        return names
    model = meta_model(config_dir, trust_remote_code, dtype)
    if model is None:  # an architecture this transformers cannot build: no renaming known
        return names
    renamings = [t for t in get_model_conversion_mapping(model) if isinstance(t, WeightRenaming)]
    params = dict.fromkeys(k for k, _ in model.named_parameters())
    prefix = getattr(model, "base_model_prefix", None)
    for key in keys:
        names.setdefault(rename_source_key(key, renamings, [], prefix, params)[0], key)
    return names
