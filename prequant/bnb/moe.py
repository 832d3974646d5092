"""`prequant.load_model`: a prequant checkpoint as a transformers 5 model, MoE experts in 4-bit, correct on the CPU.

transformers 5 fuses a native MoE layer's experts into 3-D parameters (`bnb.experts`), which cannot hold the 4-bit
experts `--quantize-experts` writes (one Linear4bit weight per expert: its `from_pretrained` fails with a size
mismatch). For such a checkpoint `load_model` builds the model on the meta device, puts a `PerExpert` module in
place of each fused experts module that has 4-bit weights (the same interface, `(hidden_states, top_k_index,
top_k_weights)`, with one linear per expert and projection, named as the checkpoint names them), turns every linear
whose weight the checkpoint holds in 4-bit into a 4-bit layer, and fills the model from the files, one tensor at a
time (the checkpoint's names through transformers' own renaming tables, e.g. Mixtral's `block_sparse_moe` -> `mlp`).
A layer whose experts the checkpoint keeps 16-bit (matched by `--skip`) keeps transformers' fused experts, filled
from the per-expert weights (`FusedExperts`, which `load_for_fsdp` shares). Any other checkpoint is loaded by
transformers' `from_pretrained` as it is.

Either way every 4-bit layer is an `ExactLinear4bit`: bitsandbytes' `Linear4bit` on a GPU; on the CPU, where
bitsandbytes' 4-bit paths give wrong values (or crash) for layers whose sizes are not multiples of 64 (in) and 32
(out), its weight is dequantized as bitsandbytes' CUDA kernel does (`stats`: code times block scale in float32,
rounded once to the weight's dtype) and multiplied by torch.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..checkpoint.hf_files import CONFIG
from ..checkpoint.reader import TensorReader, scan_files
from ..errors import PrequantError, UsageError
from .experts import ROLES, expert_match
from .format import entry_name, split_state_key
from .stats import dequantize, dequantize_absmax

# from_pretrained's keyword arguments this loader applies itself, for checkpoints with 4-bit experts.
_TAKEN = {"dtype", "torch_dtype", "device_map", "attn_implementation", "experts_implementation",
          "low_cpu_mem_usage"}


def load_model(path: str | Path, **from_pretrained_kwargs: Any) -> nn.Module:
    """Load a prequant output (a local folder or a Hub repo id) as a transformers 5 causal LM for inference.

    With 4-bit MoE experts (`prequant convert --quantize-experts`) the model holds one 4-bit linear per expert
    behind its experts interface; `dtype`, `device_map` ("cpu", "cuda", "auto", a device) and
    `attn_implementation` are taken from `from_pretrained_kwargs`, any other keyword is refused. Without them,
    the arguments go to transformers' `from_pretrained`. 4-bit layers compute correctly on the CPU too."""
    directory = _local(path)
    files = sorted(directory.glob("*.safetensors"))
    refs = {t.name: t for t in scan_files(files)}
    quantized = {found[0].removesuffix(".weight"): found[1] for name in refs
                 if (found := split_state_key(name)) is not None and found[0].endswith(".weight")}
    if not any(expert_match(f"{prefix}.weight") for prefix in quantized):
        from transformers import AutoModelForCausalLM

        # The checkpoint's own code runs only when the caller says so; transformers never asks on the terminal.
        kwargs = {"trust_remote_code": False, **from_pretrained_kwargs}
        model = AutoModelForCausalLM.from_pretrained(directory, **kwargs)
        exact_on_cpu(model)
        return model
    unknown = sorted(set(from_pretrained_kwargs) - _TAKEN)
    if unknown:
        raise UsageError(f"load_model: {', '.join(unknown)} not taken for a checkpoint with 4-bit MoE experts "
                         f"({directory}); it takes {', '.join(sorted(_TAKEN))}")
    require_transformers()
    with TensorReader() as data:
        return _load_with_experts(directory, refs, quantized, data, from_pretrained_kwargs)


# The transformers release whose key renamings (`conversion_mapping`: Mixtral's block_sparse_moe, ...) load_model is
# tested with; 5.0 renames Mixtral's and Qwen3-MoE's routers but not their experts.
TRANSFORMERS_TESTED = (5, 25)


def require_transformers() -> None:
    """Refuse, in one line, a transformers older than the one 4-bit experts are loaded and tested with."""
    import transformers

    found = tuple(int(p) for p in transformers.__version__.split(".")[:2] if p.isdigit())
    if found < TRANSFORMERS_TESTED:
        wanted = ".".join(map(str, TRANSFORMERS_TESTED))
        raise PrequantError(f"load_model of a checkpoint with 4-bit MoE experts needs transformers {wanted} or later "
                            f"(found {transformers.__version__}); pip install -U 'transformers>={wanted}'")


def _local(path: str | Path) -> Path:
    """The checkpoint folder: `path` itself, or a Hub repo's snapshot (downloaded through huggingface_hub)."""
    local = Path(path)
    if local.is_dir():
        return local
    if local.exists() or str(path).count("/") != 1:
        raise PrequantError(f"{path}: not a checkpoint folder nor a Hub repo id (org/name)")
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(str(path)))


# ---------------------------------------------------------------------------------------- 4-bit layers


def _bnb_linear4bit() -> type:
    import bitsandbytes as bnb

    return bnb.nn.Linear4bit


def dequantized_weight(weight: Any, qs: Any = None) -> torch.Tensor:
    """A 4-bit weight (packed codes) dequantized as bitsandbytes' CUDA kernel does, on its device; `qs`: its quant
    state (default: the `Params4bit`'s own)."""
    qs = qs if qs is not None else weight.quant_state
    if qs.nested:
        absmax = dequantize_absmax(qs.absmax, qs.state2.absmax, qs.state2.code, float(qs.offset), qs.state2.blocksize)
    else:
        absmax = qs.absmax.float()
    n = 1
    for d in qs.shape:
        n *= d
    # A copy of the codes: FSDP frees and refills a gathered weight's storage, which a numpy view would pin.
    packed = weight.detach().reshape(-1).view(torch.uint8).clone()
    return dequantize(packed, absmax, qs.code, qs.blocksize, n).to(qs.dtype).view(qs.shape)


def exact_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """bitsandbytes' Linear4bit forward as the matmul of the input with the exactly dequantized weight, the model's
    values: bitsandbytes' CPU path is wrong for some shapes, and on a GPU its kernels add in another order (a fused
    one for a single row, a transposed weight for many). On a GPU, a forward that autograd records (training) takes
    bitsandbytes' own, whose backward dequantizes the weight again instead of keeping it."""
    if x.numel() == 0:  # an idle expert's zero rows (`PerExpert`): nothing to dequantize
        return x.new_zeros(*x.shape[:-1], self.out_features)
    if self.weight.device.type != "cpu" and torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
        return _bnb_linear4bit().forward(self, x)
    compute = self.compute_dtype or x.dtype
    bias = None if self.bias is None else self.bias.to(compute)
    # Under FSDP the gathered weight is a plain tensor: its quant state is the module's (bitsandbytes' own rule).
    qs = getattr(self.weight, "quant_state", None) or self.quant_state
    return nn.functional.linear(x.to(compute), dequantized_weight(self.weight, qs).to(compute), bias).to(x.dtype)


_EXACT: type | None = None


def exact_class() -> type:
    """`ExactLinear4bit`: bitsandbytes' Linear4bit (peft and FSDP see one) with `exact_forward`."""
    global _EXACT
    if _EXACT is None:
        _EXACT = type("ExactLinear4bit", (_bnb_linear4bit(),), {"forward": exact_forward, "__module__": __name__})
    return _EXACT


def exact_on_cpu(model: nn.Module) -> None:
    """Give every bitsandbytes Linear4bit of `model` the exact forward (on the CPU; bitsandbytes' own elsewhere)."""
    base, exact = _bnb_linear4bit(), exact_class()
    for module in model.modules():
        if type(module) is base:
            module.__class__ = exact


# ---------------------------------------------------------------------------------------- experts


class Expert(nn.Module):
    """One expert's projections, as `nn.Linear` layers named as the checkpoint names them (`gate_proj`, Mixtral's
    `w1`, ...), in the dtype of the fused experts they replace."""

    def __init__(self, names: dict[str, str], hidden: int, intermediate: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.names = names  # role (gate, up, down) -> the projection's name
        for role, name in names.items():
            shape = (intermediate, hidden) if role != "down" else (hidden, intermediate)
            setattr(self, name, nn.Linear(shape[1], shape[0], bias=False, device="meta", dtype=dtype))

    def role(self, role: str) -> nn.Module:
        return getattr(self, self.names[role])


class PerExpert(nn.ModuleList):
    """A MoE layer's experts, one `Expert` each, behind transformers 5's experts interface: for each expert,
    `down(act(gate(x)) * up(x))` of its tokens, weighted by the router, summed (the eager loop of transformers'
    fused experts, whose gate_up_proj holds each expert's gate rows, then its up rows).

    An expert no token reached runs too, on zero rows: its output is empty, but every trainable parameter in it
    (LoRA) gets a gradient, zeros. Data-parallel ranks route other tokens, so an expert idle on one rank is busy on
    another; FSDP reduce-scatters the same gradients on every rank, and a parameter without one on some rank breaks
    that collective (gloo aborts on the size mismatch, NCCL hangs or averages the wrong tensors). Zero rows cost no
    dequantization (a 4-bit layer returns at once for an empty input) and keep the autograd graph, hence the
    backward's collectives, the same on every rank and in a recomputation under activation checkpointing."""

    def __init__(self, experts: list[Expert], act_fn: nn.Module) -> None:
        super().__init__(experts)
        self.num_experts = len(experts)
        self.__dict__["act_fn"] = act_fn  # parameterless, and not one of the list's entries

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        final = torch.zeros_like(hidden_states)
        mask, hit = self.routed(top_k_index)
        none = top_k_index.new_empty(0)
        for index in range(self.num_experts):
            # an idle expert's rows: none, without the host sync of torch.where
            top_k_pos, token_idx = torch.where(mask[index]) if index in hit else (none, none)
            self.add_expert(final, index, hidden_states, token_idx, top_k_pos, top_k_weights)
        return final

    def routed(self, top_k_index: torch.Tensor) -> tuple[torch.Tensor, set[int]]:
        """The routing mask `[experts + 1, top_k, tokens]` and the experts that received a token."""
        with torch.no_grad():
            mask = nn.functional.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
            hit = set(torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero().flatten().tolist()) - {self.num_experts}
        return mask, hit

    def add_expert(self, final: torch.Tensor, index: int, hidden_states: torch.Tensor, token_idx: torch.Tensor,
                   top_k_pos: torch.Tensor, top_k_weights: torch.Tensor) -> None:
        """Add expert `index`'s output for its tokens (`token_idx`, their `top_k_pos` choice), weighted, to `final`."""
        expert = self[index]
        x = hidden_states[token_idx]
        h = self.act_fn(expert.role("gate")(x)) * expert.role("up")(x)
        h = expert.role("down")(h) * top_k_weights[token_idx, top_k_pos, None]
        final.index_add_(0, token_idx, h.to(final.dtype))


def fused_experts(model: nn.Module) -> dict[str, nn.Module]:
    """name -> each fused experts module (transformers 5's `gate_up_proj [E, 2I, H]` + `down_proj [E, H, I]`)."""
    found = {}
    for name, module in model.named_modules():
        gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
        if isinstance(gate_up, nn.Parameter) and isinstance(down, nn.Parameter) and gate_up.dim() == 3:
            found[name] = module
    return found


def expert_roles(keys: Any) -> dict[str, dict[str, str]]:
    """{experts module: {role: projection name}} of the per-expert weights among `keys` (tensor names)."""
    roles: dict[str, dict[str, str]] = {}
    for key in keys:
        if (m := expert_match(key)) is not None:
            roles.setdefault(f"{m['block']}.experts", {})[ROLES[m["proj"]]] = m["proj"]
    return roles


def _check_layout(name: str, module: nn.Module) -> None:
    """Refuse a fused experts module whose layout is not transformers' concatenated, untransposed, biasless
    gate-and-up one: the checkpoint's per-expert weights map onto no other."""
    layout = (getattr(module, "is_concatenated", True), getattr(module, "is_transposed", False),
              getattr(module, "has_bias", False), getattr(module, "has_gate", True),
              getattr(module, "has_post_expert_norm", False))
    e, two_i, hidden = module.gate_up_proj.shape
    if layout != (True, False, False, True, False) or tuple(module.down_proj.shape) != (e, hidden, two_i // 2):
        raise PrequantError(f"{name} ({type(module).__name__}) is not a MoE layout prequant loads per expert "
                            "(concatenated gate and up, untransposed, no bias); load the checkpoint with "
                            "transformers' from_pretrained, converted without --quantize-experts")


def unfuse(model: nn.Module, names: dict[str, dict[str, str]], quantized: set[str]) -> dict[str, nn.Module]:
    """Put a `PerExpert` (meta linears) in place of each fused experts module that has 4-bit weights (`quantized`:
    experts module names); `names`: each experts module's {role: projection name} as the checkpoint names them.
    Returns the fused experts modules left as they are (name -> module): those whose experts the checkpoint keeps
    16-bit."""
    kept = {}
    for name, module in fused_experts(model).items():
        if name not in quantized:
            kept[name] = module
            continue
        _check_layout(name, module)
        roles = names[name]
        if set(roles) != {"gate", "up", "down"}:
            raise PrequantError(f"{name} ({type(module).__name__}): the checkpoint has no "
                                f"{', '.join(sorted({'gate', 'up', 'down'} - set(roles)))} projection weights for "
                                "these experts; is this a complete checkpoint?")
        e, two_i, hidden = module.gate_up_proj.shape
        experts = [Expert(roles, hidden, two_i // 2, module.gate_up_proj.dtype) for _ in range(e)]
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, PerExpert(experts, module.act_fn))
    return kept


class FusedExperts:
    """One fused experts parameter of transformers 5 (`gate_up_proj` [E, 2I, H]: each expert's gate rows, then its up
    rows; `down_proj` [E, H, I]) as the checkpoint's per-expert 16-bit weights make it: `keys[e]` are expert e's
    tensors, concatenated in that order, read through `view` (key -> tensor). `copy_rows` fills experts
    [start, stop) only: an FSDP rank reads its own experts."""

    def __init__(self, view: Callable[[str], torch.Tensor], keys: list[list[str]], shape: tuple[int, ...]) -> None:
        self.view, self.keys, self.shape = view, keys, shape

    def copy_rows(self, out: torch.Tensor, start: int, stop: int) -> None:
        for i, parts in enumerate(self.keys[start:stop]):
            row = 0
            for key in parts:
                value = self.view(key)
                out[i, row : row + value.shape[0]].copy_(value)
                row += value.shape[0]


def fused_from_experts(fused: dict[str, nn.Module], tensors: dict[str, Any], view: Callable[[str], torch.Tensor],
                       where: Path) -> dict[str, FusedExperts]:
    """{fused parameter name: FusedExperts} for each fused experts module in `fused` whose parameters the checkpoint
    holds per expert: `tensors` (the model's names -> refs with a shape), read through `view`. A module whose fused
    parameters the checkpoint holds as they are is left out; a missing expert weight is refused, naming it."""
    found: dict[str, dict[int, dict[str, str]]] = {}  # experts module -> expert -> role -> key
    for key in tensors:
        if (m := expert_match(key)) is not None:
            found.setdefault(f"{m['block']}.experts", {}).setdefault(int(m["index"]), {})[ROLES[m["proj"]]] = key
    out: dict[str, FusedExperts] = {}
    for name, module in fused.items():
        if f"{name}.gate_up_proj" in tensors and f"{name}.down_proj" in tensors:
            continue
        _check_layout(name, module)
        experts = found.get(name, {})
        keys: dict[str, list[list[str]]] = {"gate_up_proj": [], "down_proj": []}
        for e in range(module.gate_up_proj.shape[0]):
            roles = experts.get(e, {})
            missing = [r for r in ("gate", "up", "down") if r not in roles]
            if missing:
                raise PrequantError(f"{where}: no {missing[0]} projection weight for expert {e} of {name}; "
                                    "the model needs every expert's weights (is this a complete checkpoint?)")
            keys["gate_up_proj"].append([roles["gate"], roles["up"]])
            keys["down_proj"].append([roles["down"]])
        for param, parts in keys.items():
            first = [tuple(tensors[k].shape) for k in parts[0]]
            shape = (len(parts), sum(s[0] for s in first), first[0][1])
            out[f"{name}.{param}"] = FusedExperts(view, parts, shape)
    return out


# ---------------------------------------------------------------------------------------- the loader


def _load_with_experts(directory: Path, refs: dict, quantized: dict[str, str], data: TensorReader,
                       kwargs: dict[str, Any]) -> nn.Module:
    from accelerate import init_empty_weights
    from bitsandbytes.nn import Params4bit
    from transformers import AutoConfig, AutoModelForCausalLM

    config_json = json.loads((directory / CONFIG).read_text())
    if config_json.get("auto_map"):
        raise PrequantError(f"{directory}: load_model builds transformers' own architectures; this one is remote code")
    overrides = {k: kwargs[k] for k in ("attn_implementation", "experts_implementation") if k in kwargs}
    config = AutoConfig.from_pretrained(directory, trust_remote_code=False, **overrides)
    dtype = _dtype(kwargs.get("dtype", kwargs.get("torch_dtype", "auto")), config)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=False)
    to_model = renamer(model)
    weights = {to_model(f"{p}.weight").removesuffix(".weight"): p for p in quantized}  # model module -> ckpt prefix
    named = {to_model(k): ref for k, ref in refs.items()}
    kept = unfuse(model, expert_roles(named), set(expert_roles(f"{m}.weight" for m in weights)))
    fused = fused_from_experts(kept, named, lambda key: data.view(named[key]), directory)

    compute = getattr(torch, str(config_json["quantization_config"].get("bnb_4bit_compute_dtype", "float32")))
    exact = exact_class()
    for module_name, prefix in weights.items():
        try:
            old = model.get_submodule(module_name)
        except AttributeError:
            old = None
        if not isinstance(old, nn.Linear):
            raise PrequantError(f"{directory}: 4-bit tensor {prefix}.weight has no linear layer {module_name!r} "
                                f"in {type(model).__name__}; is config.json the checkpoint's own?")
        weight = f"{prefix}.weight"
        stats = {entry_name(weight, k): data.view(refs[k]).clone() for k in refs
                 if k.startswith(weight + ".")}
        new = exact(old.in_features, old.out_features, bias=old.bias is not None, compute_dtype=compute,
                    device="meta")
        new.weight = Params4bit.from_prequantized(data.view(refs[weight]).clone(), stats, device="cpu", module=new)
        if old.bias is not None:
            new.bias = old.bias
        parent, _, child = module_name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, new)

    for name, experts in fused.items():  # experts kept 16-bit: transformers' fused parameters, filled per expert
        value = torch.empty(experts.shape, dtype=model.get_parameter(name).dtype)
        experts.copy_rows(value, 0, experts.shape[0])
        _assign(model, name, value, True)
    state = dict(model.named_parameters())
    state.update(model.named_buffers())
    done = {f"{m}.weight" for m in weights} | set(fused)
    for key, ref in refs.items():
        if _is_companion(key, quantized):
            continue
        name = to_model(key)
        if name in done:
            continue
        target = state.get(name)
        if target is None:
            continue  # a tensor the model has no parameter for: transformers ignores it too
        value = data.view(ref)
        if tuple(value.shape) != tuple(target.shape):
            raise PrequantError(f"{directory}: {key} is {list(value.shape)}, but {type(model).__name__} expects "
                                f"{list(target.shape)}; is config.json the checkpoint's own?")
        _assign(model, name, value.to(target.dtype, copy=True), isinstance(target, nn.Parameter))
        done.add(name)
    model.tie_weights()
    missing = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if missing:
        raise PrequantError(f"{directory}: no tensor for the model's parameter {missing[0]!r}"
                            + (f" and {len(missing) - 1} more" if len(missing) > 1 else "")
                            + "; is this a complete checkpoint?")
    model.is_loaded_in_4bit = True  # what transformers' bitsandbytes quantizer sets (peft reads it)
    model.eval()
    device = _device(kwargs.get("device_map"))
    return model.to(device) if device.type != "cpu" else model


def _is_companion(key: str, quantized: dict[str, str]) -> bool:
    """Whether `key` is a 4-bit weight's own tensor (its packed codes or a quant-state entry)."""
    prefix, sep, _ = key.partition(".weight")
    return bool(sep) and prefix in quantized


def renamer(model: nn.Module):
    """checkpoint key -> the model's name for it, through transformers' renamings (not its expert fusing)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, rename_source_key
    except ImportError as e:
        raise PrequantError(f"load_model needs transformers 5 ({e}); with transformers 4.x use from_pretrained") from e
    renamings = [t for t in get_model_conversion_mapping(model) if isinstance(t, WeightRenaming)]
    params = dict.fromkeys(k for k, _ in model.named_parameters())
    prefix = getattr(model, "base_model_prefix", None)

    def rename(key: str) -> str:
        return rename_source_key(key, renamings, [], prefix, params)[0]

    return rename


def _assign(model: nn.Module, name: str, value: torch.Tensor, parameter: bool) -> None:
    owner, _, attr = name.rpartition(".")
    module = model.get_submodule(owner) if owner else model
    if parameter:
        setattr(module, attr, nn.Parameter(value, requires_grad=False))
    else:
        module.register_buffer(attr, value, persistent=attr not in module._non_persistent_buffers_set)


def _dtype(value: Any, config: Any) -> torch.dtype:
    """from_pretrained's `dtype`: a torch dtype, its name, or "auto" (config.json's, else bfloat16)."""
    if isinstance(value, torch.dtype):
        return value
    if value == "auto":
        value = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.bfloat16
        return value if isinstance(value, torch.dtype) else getattr(torch, str(value).removeprefix("torch."))
    found = getattr(torch, str(value).removeprefix("torch."), None)
    if not isinstance(found, torch.dtype):
        raise UsageError(f"load_model: dtype {value!r} is not a torch dtype")
    return found


def _device(device_map: Any) -> torch.device:
    """One device for the whole model: "auto" (a GPU when there is one), "cpu", "cuda[:N]", an index or a device."""
    if device_map is None:
        return torch.device("cpu")
    if device_map == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if isinstance(device_map, dict):
        devices = set(device_map.values())
        if len(devices) != 1:
            raise UsageError("load_model puts a model with 4-bit experts on one device; pass device_map='auto', "
                             "'cpu' or 'cuda:N'")
        device_map = devices.pop()
    return torch.device(device_map if not isinstance(device_map, int) else f"cuda:{device_map}")
