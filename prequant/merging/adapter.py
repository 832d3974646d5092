"""A peft LoRA adapter, read for merging: its config, and for each base tensor it changes, the adapter tensors
that change it (by reference: nothing is read until the pipeline reaches that tensor).

peft saves an adapter as adapter_config.json + adapter_model.safetensors (or .bin), its keys under
`base_model.model.` followed by the module's name in the model peft wrapped:

    <module>.lora_A.weight, <module>.lora_B.weight     a Linear (or GPT-2 Conv1D) target
    <module>.lora_embedding_A, <module>.lora_embedding_B   an Embedding target
    <module>.lora_magnitude_vector                     DoRA's magnitude of that target
    <module>.base_layer.weight                         the embedding itself (save_embedding_layers)
    <module>.weight, <module>.bias, ...                modules_to_save: whole tensors that replace the base's

The module names are those of the model the adapter was trained on: transformers 4 names them as the checkpoint
does, transformers 5 (and `load_for_fsdp` for MoE experts) may rename them on load (`base_names` maps them back).
Anything else (another peft type, a LoRA bias, a key no base tensor matches) is refused, naming it.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..checkpoint.reader import scan_files
from ..checkpoint.tensors import TensorRef, quote
from ..errors import PrequantError

CONFIG_NAME = "adapter_config.json"
WEIGHT_NAMES = ("adapter_model.safetensors", "adapter_model.bin")
PREFIX = "base_model.model."
_LORA_PARTS = {"lora_A.weight": "a", "lora_B.weight": "b", "lora_embedding_A": "a", "lora_embedding_B": "b",
               "lora_magnitude_vector": "magnitude", "base_layer.weight": "base"}
_UNSUPPORTED_PARTS = ("lora_B.bias", "lora_A.bias", "lora_embedding_A.weight", "lora_embedding_B.weight")


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
    identity: dict = field(default_factory=dict)  # spec, repo and commit (a Hub adapter), config sha256

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
    if config.get("target_parameters"):
        raise PrequantError("target_parameters is set: LoRA on bare parameters (fused MoE experts) is not supported; "
                            "merge it with peft, or train on per-expert linears (load_for_fsdp)", where=path)
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


def wanted(adapter: Adapter) -> list[str]:
    """The base tensors the adapter's keys name, as the trained model named them."""
    return [key if part is None else f"{module}.weight" for key in adapter.tensors
            for module, part in [_split(key)]]


def targets(adapter: Adapter, base_keys: dict[str, str]) -> dict[str, Target]:
    """Each base tensor the adapter changes (by its key in the base checkpoint) and how. `base_keys` maps a tensor's
    name in the trained model to its key in the base checkpoint (`base_names`). Every adapter key must
    find its base tensor; one that does not is refused, naming it."""
    cfg = adapter.config
    found: dict[str, Target] = {}
    for key, ref in adapter.tensors.items():
        module, part = _split(key)
        if part is None:  # modules_to_save: a whole tensor under the module's own name
            base = _base_key(key, base_keys, adapter)
            target = found.setdefault(base, Target(base, module))
            target.replace = ref
            continue
        base = _base_key(f"{module}.weight", base_keys, adapter, shown=key)
        target = found.setdefault(base, Target(base, module))
        setattr(target, _LORA_PARTS[part], ref)
        target.embedding = target.embedding or part.startswith("lora_embedding")
    for target in found.values():
        if target.replace is not None and (target.lora or target.base or target.magnitude):
            raise PrequantError(f"{quote(target.key)} is both in modules_to_save and a LoRA target; save the "
                                "adapter again with peft", where=adapter.files[0])
        if target.replace is not None:
            continue
        if target.a is None or target.b is None:
            raise PrequantError(f"module {quote(target.module)} has {'lora_B' if target.a is None else 'lora_A'} but "
                                f"not {'lora_A' if target.a is None else 'lora_B'}; the adapter is incomplete: save "
                                "it again", where=adapter.files[0])
        r = target.a.shape[0]
        rank, alpha = _pattern(cfg, "rank_pattern", target.module, cfg.get("r", 8)), \
            _pattern(cfg, "alpha_pattern", target.module, cfg.get("lora_alpha", 8))
        if rank != r:
            raise PrequantError(f"module {quote(target.module)} has rank {r} in its tensors but {rank} in "
                                f"{CONFIG_NAME}; the adapter's config does not match its weights", where=adapter.files[0])
        target.scaling = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
        target.fan_in_fan_out = bool(cfg.get("fan_in_fan_out")) and not target.embedding
        if target.embedding and target.magnitude is not None:
            raise PrequantError(f"module {quote(target.module)}: DoRA on an embedding is not supported; merge it "
                                "with peft", where=adapter.files[0])
    return found


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


def base_names(keys: list[str], config_dir: Path, wanted: list[str]) -> dict[str, str]:
    """{a tensor's name in the trained model: its key in the base checkpoint}. Names are the checkpoint's own
    (transformers 4, and models transformers 5 does not rename); when one of `wanted` is not among `keys`, the
    checkpoint's keys are also renamed as transformers 5 renames them on load (its renaming tables, on the model
    built on the meta device), so adapters trained on either match."""
    names = {k: k for k in keys}
    if all(w in names for w in wanted):
        return names
    try:
        import torch
        import transformers
        from transformers import AutoConfig
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, rename_source_key
    except ImportError:  # no transformers 5: the checkpoint's names are the only ones
        return names
    try:
        cfg = AutoConfig.from_pretrained(config_dir)
        cls = getattr(transformers, (getattr(cfg, "architectures", None) or [""])[0], None)
        with torch.device("meta"):
            model = cls._from_config(cfg) if cls is not None else transformers.AutoModelForCausalLM.from_config(cfg)
    except Exception:  # noqa: BLE001 - an architecture this transformers cannot build: no renaming known
        return names
    renamings = [t for t in get_model_conversion_mapping(model) if isinstance(t, WeightRenaming)]
    params = dict.fromkeys(k for k, _ in model.named_parameters())
    prefix = getattr(model, "base_model_prefix", None)
    for key in keys:
        names.setdefault(rename_source_key(key, renamings, [], prefix, params)[0], key)
    return names
