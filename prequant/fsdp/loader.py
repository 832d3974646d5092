"""Load a 4-bit checkpoint for FSDP+QLoRA, each rank reading only its own shard of every tensor.

`transformers.from_pretrained` puts the whole quantized model on every rank's GPU before FSDP shards it; for a model
of hundreds of GB that does not fit any one GPU. `load_for_fsdp` instead:

1. builds the model on the meta device from the checkpoint's config (no memory), with bitsandbytes `Linear4bit`
   layers exactly where the checkpoint holds quantized weights (`Checkpoint`: the files opened for slicing);
2. applies LoRA with peft (still on meta), initialized by name so any number of ranks gets the same weights;
3. wraps it with FSDP2 `fully_shard` (each decoder layer, the input embedding, then the root);
4. allocates only the local shards (`to_empty`) and fills them from the memory-mapped safetensors: a rank touches
   only the rows it owns (`local_rows`), copied straight to its device; the small quant states (absmax, nested
   absmax, code tables) are read whole on every rank.

Why FSDP2 with packed weights held as uint8: FSDP2 shards per parameter on dim 0, so a rank's shard of a packed
`[n, 1]` weight is one contiguous byte range of the file: nothing to flatten, nothing to broadcast. But FSDP2
gathers a group of same-dtype parameters with `torch._foreach_copy_`, which on CUDA round-trips bf16 through fp32
and rewrites NaN bit patterns (bitsandbytes issue #1945): packed NF4 bytes stored as bf16 hit such patterns about
once per thousand elements. Holding the packed bytes as a uint8 parameter (frozen, so FSDP2 accepts a non-float
dtype) gives the group mixed dtypes, and FSDP2 then gathers everything as raw bytes. The bytes are the checkpoint's:
bitsandbytes reads the same codes from uint8 and from bf16 storage. A torch without non-float FSDP2 parameters gets
a two-line fix from `prequant.fsdp.compat`.
"""

from __future__ import annotations

import functools
import json
import math
import zlib
from collections.abc import Iterator
from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

from .. import settings
from ..bnb.format import COMPANIONS, decode_quant_state, entry_key, entry_name, split_state_key, state_key
from ..bnb.moe import exact_class
from ..checkpoint.hf_files import CONFIG
from ..checkpoint.reader import TensorReader, scan_files
from ..errors import PrequantError, UsageError
from ..source.resolve import resolve
from .experts import lora_on_fused, lora_targets_as_named, per_expert

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

PackedStorage = Literal["uint8", "checkpoint"]
# What torchrun (and `accelerate launch`, which runs it) exports to every rank.
LAUNCHER_ENV = settings.LAUNCHER


def load_for_fsdp(
    checkpoint_dir: str | Path,
    *,
    lora_r: int = 16,
    lora_alpha: int = 32,
    lora_dropout: float = 0.0,
    target_modules: str | list[str] = "all-linear",
    seed: int = 0,
    device_mesh: DeviceMesh | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.bfloat16,
    mp_policy: MixedPrecisionPolicy | None = None,
    buffer_dtype: torch.dtype | None = None,
    reshard_after_forward: bool = True,
    gradient_checkpointing: bool = False,
    packed_storage: PackedStorage = "uint8",
    trust_remote_code: bool = False,
) -> Any:
    """Build a LoRA-wrapped, FSDP2-sharded model from a 4-bit checkpoint, reading only this rank's shards.

    Call it on every rank under torchrun or `accelerate launch`. Without a process group it sets one up the way
    the Hugging Face Trainer does (`ensure_process_group`), so `TrainingArguments` may
    be created before or after it. Returns the peft model with `fully_shard` applied to each decoder layer, the
    input embedding and the root; only the LoRA parameters require grad, and `state_dict()` holds them alone
    (frozen weights as empty tensors: `keep_frozen_weights_out_of_state_dict`), so saving gathers the
    adapter, not the checkpoint. For `transformers.Trainer` and TRL's `SFTTrainer`, build the arguments with
    `prequant.fsdp.trainer_args`. Arguments:

    - `lora_r`, `lora_alpha`, `lora_dropout`, `target_modules`: the peft `LoraConfig` ("all-linear" as in
      the Hugging Face QLoRA recipes: every linear layer but the output head).
    - `seed`: LoRA A matrices are drawn from peft's default distribution (kaiming-uniform, a=sqrt(5)) by a
      generator seeded from `seed` and the parameter's name, B is zero: the same values on any number of
      ranks and with `init_lora_weights` on an unsharded model.
    - `device_mesh`: a 1-D mesh to shard over (default: all ranks); `device`: default `cuda:LOCAL_RANK`
      when CUDA is available, else `cpu` (gloo; for tests).
    - `dtype`: dtype of the unquantized parameters (embeddings, norms, head), as `from_pretrained(dtype=)`.
    - `mp_policy`: FSDP2 mixed precision; default computes in `dtype` and reduces gradients in fp32.
    - `buffer_dtype`: cast floating-point buffers (RoPE `inv_freq`) to this dtype. None keeps them in fp32.
      The Hugging Face Trainer's FSDP-QLoRA setup casts them to bf16 (FSDP1 `buffer_dtype`); pass
      `torch.bfloat16` to reproduce its numbers exactly.
    - `packed_storage`: "uint8" (default) holds packed weights as uint8 so FSDP2 gathers them as bytes;
      "checkpoint" keeps the checkpoint's storage dtype (bf16), exposed to bitsandbytes issue #1945 on CUDA.
    """
    import torch.distributed as dist

    if packed_storage not in ("uint8", "checkpoint"):
        raise UsageError(f"packed_storage {packed_storage!r} is not supported; use 'uint8' or 'checkpoint'")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    device = torch.device(device) if device is not None else default_device()
    ensure_process_group(device)
    _destroy_at_exit()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if device_mesh is None:
        device_mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    if mp_policy is None:
        mp_policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)

    if packed_storage == "uint8":
        from .compat import ensure_nonfloat_params

        ensure_nonfloat_params()  # a torch without pytorch#178075 cannot shard frozen uint8 parameters unaided
    ckpt = Checkpoint(checkpoint_dir)
    try:
        packed_dtype = torch.uint8 if packed_storage == "uint8" else None
        model, keys = _build_meta_model(ckpt, dtype=dtype, packed_dtype=packed_dtype, trust_remote_code=trust_remote_code)
        if gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        with lora_targets_as_named(model) if model._prequant_per_expert else nullcontext():
            model = apply_lora(model, lora_r, lora_alpha, lora_dropout, target_modules)
        # peft needed the 4-bit mark to build its LoRA layers on bitsandbytes'; past this point it would only make
        # TRL's SFTTrainer cast the LoRA weights to bf16 through `param.data = ...`, which on FSDP2's DTensor
        # parameters changes the outer dtype and not the local shard (the optimizer then fails on mixed dtypes).
        # Without it the LoRA weights stay fp32 masters that `mp_policy` computes in `dtype`, under any loop.
        del model.get_base_model().is_loaded_in_4bit
        keep_frozen_weights_out_of_state_dict(model)
        keys = _rename(model, keys)

        for module in decoder_layers(model):
            fully_shard(module, mesh=device_mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward)
        embed = model.get_input_embeddings()
        out = model.get_output_embeddings()
        if embed is not None and (out is None or out.weight is not embed.weight):  # a tied pair stays in the root
            fully_shard(embed, mesh=device_mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward)
        fully_shard(model, mesh=device_mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward)

        # to_empty allocates every local shard (and wipes buffers: RoPE tables were computed on the CPU at
        # construction, keep them), then the shards are filled from the file, one parameter at a time.
        buffers = {n: b.detach().to("cpu", copy=True) for n, b in model.named_buffers()}
        model.to_empty(device=device)
        with torch.no_grad():
            for name, b in model.named_buffers():
                b.copy_(ckpt.view(keys[name]) if name in keys else buffers[name])
                if buffer_dtype is not None and b.is_floating_point():
                    _set_buffer(model, name, b.to(buffer_dtype))
            _fill_shards(model, ckpt, keys, seed)
            for module in model.modules():
                prefix = getattr(module, "_prequant_prefix", None)
                if prefix is not None:
                    module.quant_state = ckpt.quant_state(prefix, device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dist.barrier()
        model.train()
        return model
    finally:
        ckpt.close()


def _build_meta_model(
    ckpt: Checkpoint, *, dtype: torch.dtype, packed_dtype: torch.dtype | None, trust_remote_code: bool
) -> tuple[torch.nn.Module, dict[int, str]]:
    """The model on the meta device (buffers real, on the CPU), quantized layers as bitsandbytes Linear4bit
    holding packed-shaped meta weights; returns it and {id(tensor): checkpoint key} for params and buffers."""
    from accelerate import init_empty_weights
    from bitsandbytes.nn import Linear4bit, Params4bit
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(ckpt.path, trust_remote_code=trust_remote_code)
    qc = ckpt.quantization_config
    compute_dtype = getattr(torch, str(qc.get("bnb_4bit_compute_dtype", "bfloat16")).removeprefix("torch."))
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
    model.tie_weights()  # skipped on meta weights; a tied head must be the embedding's parameter, not a copy
    model._prequant_per_expert = per_expert(model, ckpt)  # MoE: one 4-bit linear per expert
    linear4bit = exact_class() if model._prequant_per_expert else Linear4bit  # MoE shapes bitsandbytes' CPU gets wrong
    for prefix, quant_type in ckpt.quantized.items():
        try:
            old = model.get_submodule(prefix)
        except AttributeError as e:
            raise PrequantError(
                f"{ckpt.path}: quantized tensor {prefix}.weight has no module {prefix!r} in "
                f"{type(model).__name__}; load_for_fsdp needs checkpoint names that match the model's"
            ) from e
        if not isinstance(old, torch.nn.Linear):
            raise PrequantError(f"{prefix} is a {type(old).__name__}, not nn.Linear: cannot hold 4-bit weights")
        meta_packed = ckpt.packed(prefix, packed_dtype).to("meta")
        qs = decode_quant_state(bytes(ckpt.view(state_key(f"{prefix}.weight", quant_type)).tolist()))
        new = linear4bit(old.in_features, old.out_features, bias=old.bias is not None, compute_dtype=compute_dtype,
                         compress_statistics=f"{prefix}.weight.nested_absmax" in ckpt.tensors,
                         quant_type=quant_type, quant_storage=meta_packed.dtype, device="meta")
        new.weight = Params4bit(meta_packed, requires_grad=False, blocksize=qs.get("blocksize", 64),
                                compress_statistics=new.weight.compress_statistics, quant_type=quant_type,
                                quant_storage=meta_packed.dtype, module=new, bnb_quantized=True)
        if old.bias is not None:
            new.bias = old.bias
        new._prequant_prefix = prefix  # where its quant state lives, found again after peft and FSDP
        parent, _, child = prefix.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, new)
    model.is_loaded_in_4bit = True  # what transformers' bnb quantizer sets; peft reads it to pick its 4-bit layers
    model.config.use_cache = False
    keys: dict[int, str] = {}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if name in ckpt.tensors or name in ckpt.fused:
            keys[id(t)] = name
        elif isinstance(t, torch.nn.Parameter):
            raise PrequantError(
                f"{ckpt.path}: no tensor {name!r} for the model's parameter of that name; load_for_fsdp needs "
                "checkpoint names that match the model's (a checkpoint written by prequant or save_pretrained)"
            )
    return model, keys


def _rename(model: torch.nn.Module, keys: dict[int, str]) -> dict[str, str]:
    """{name in the peft model: checkpoint key}: peft keeps the tensors and only renames them."""
    return {n: keys[id(t)] for n, t in [*model.named_parameters(), *model.named_buffers()] if id(t) in keys}


def _set_buffer(model: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    owner, _, attr = name.rpartition(".")
    (model.get_submodule(owner) if owner else model).register_buffer(attr, value, persistent=False)


def _fill_shards(model: torch.nn.Module, ckpt: Checkpoint, keys: dict[str, str], seed: int) -> None:
    """Copy each parameter's local rows from the mapped file (or the LoRA init) into its shard."""
    from torch.distributed.tensor import DTensor

    for name, param in model.named_parameters():
        local = param.to_local() if isinstance(param, DTensor) else param.data
        start, stop = local_rows(param)
        if name in keys:
            key = keys[name]
            prefix = key.removesuffix(".weight")
            fused = ckpt.fused.get(key)  # 16-bit experts, fused from the checkpoint's per-expert weights
            if fused is not None:
                src = fused
            elif prefix in ckpt.quantized:
                src = ckpt.packed(prefix, local.dtype)
            else:
                src = ckpt.view(key)
            if tuple(src.shape) != tuple(param.shape):
                raise PrequantError(f"{ckpt.path}: {key} is {tuple(src.shape)} in the file, the model expects "
                                    f"{tuple(param.shape)}; is config.json the checkpoint's own?")
            if fused is not None:
                fused.copy_rows(local, start, stop)
            else:
                local.copy_(_read_rows(src, start, stop))
        elif ".lora_A." in name or ".lora_B." in name:
            local.copy_(lora_init_value(name, tuple(param.shape), seed)[start:stop])
        else:
            raise PrequantError(f"parameter {name!r} is neither in the checkpoint nor a LoRA weight")


def _read_rows(src: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Rows [start, stop) of a mapped tensor, still a view: the copy that follows reads only their pages."""
    return src[start:stop]


# ---------------------------------------------------------------------------------- the checkpoint


class Checkpoint:
    """A bitsandbytes 4-bit checkpoint opened for slicing: headers validated, files memory-mapped on demand."""

    def __init__(self, path: str | Path) -> None:
        src = resolve(str(path))
        if src.format != "safetensors":
            raise PrequantError(f"{src.path}: load_for_fsdp reads safetensors checkpoints; convert it with prequant first")
        self.path = src.path
        self.tensors = {t.name: t for t in scan_files(src.weight_files)}
        self.fused: dict[str, Any] = {}  # fused 16-bit experts parameters, by model name (bnb.moe.FusedExperts)
        self.files = src.weight_files
        self.data = TensorReader()
        try:
            self.config = json.loads((self.path / CONFIG).read_text())
        except (OSError, ValueError) as e:
            raise PrequantError(f"{self.path}/config.json: cannot read it ({e}); is this a checkpoint directory?") from e
        qc = self.config.get("quantization_config") or {}
        if qc.get("quant_method") != "bitsandbytes" or not qc.get("load_in_4bit"):
            raise PrequantError(
                f"{self.path}: config.json has no bitsandbytes 4-bit quantization_config; convert the checkpoint "
                "with `prequant convert` first"
            )
        self.quantization_config: dict[str, Any] = qc
        # Quantized layers are those with a packed quant state in the file: the checkpoint, not a guess from
        # the architecture, says which modules become Linear4bit.
        self.quantized: dict[str, str] = {}
        for name in self.tensors:
            found = split_state_key(name)
            if found is not None and found[0].endswith(".weight"):
                self.quantized[found[0].removesuffix(".weight")] = found[1]
        # Each quantized layer's quant-state entries (absmax, code tables, ...), found in one pass: looking
        # them up per layer would scan every name once per layer.
        self._state_keys: dict[str, list[str]] = {p: [] for p in self.quantized}
        for name in self.tensors:
            prefix, sep, _ = name.partition(".weight.")
            if sep and prefix in self._state_keys:
                self._state_keys[prefix].append(name)

    def view(self, name: str) -> torch.Tensor:
        """The tensor as a zero-copy CPU view of the mapped file (file-backed pages, never anonymous memory)."""
        return self.data.view(self.tensors[name])

    def packed(self, prefix: str, dtype: torch.dtype | None) -> torch.Tensor:
        """The packed codes of a quantized layer, as `[bytes // itemsize, 1]` of `dtype` (None: as stored)."""
        t = self.view(prefix + ".weight")
        if dtype is None or dtype == t.dtype:
            return t
        return t.reshape(-1).view(torch.uint8).view(dtype).reshape(-1, 1)

    def quant_state(self, prefix: str, device: torch.device) -> Any:
        """The layer's complete bitsandbytes QuantState on `device` (small: every rank holds all of it)."""
        from bitsandbytes.functional import QuantState

        weight = prefix + ".weight"
        # clone(): the state must not keep a view of the mapping alive (nor alias file pages on CPU).
        parts = {entry_name(weight, k): self.view(k).clone() for k in self._state_keys[prefix]}
        return QuantState.from_dict(parts, device=device)

    @property
    def nbytes(self) -> int:
        return sum(f.stat().st_size for f in self.files)

    def close(self) -> None:
        self.data.close()


# ---------------------------------------------------------------------------------- the process group


def missing_launcher_env() -> list[str]:
    """The variables a launcher (torchrun, `accelerate launch`) exports to every rank that this process lacks: none
    under a launcher, all of them in a script started with plain `python`."""
    return settings.missing_launcher()


def init_distributed() -> torch.device:
    """Under a launcher: this rank's device (`default_device`), made current, and the process group on it (NCCL on
    GPUs, gloo on the CPU). Returns the device."""
    import torch.distributed as dist

    _require_launcher("init_distributed")
    device = default_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")
    return device


def ensure_process_group(device: torch.device) -> None:
    """Set up the process group when none exists yet, the way the Hugging Face Trainer will.

    accelerate's `PartialState` is what `TrainingArguments` (hence Trainer and TRL) initializes torch.distributed
    with; doing it through the same call here means a script may create its model before or after its
    `TrainingArguments`: both see one process group on one backend (NCCL on GPUs; gloo on the CPU, as with
    `use_cpu=True`), and `TrainingArguments` created later reuses it. Without a launcher there is no group to
    join: that is a usage error, also for a single GPU (`torchrun --nproc_per_node 1`)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return
    _require_launcher("load_for_fsdp")
    from accelerate import PartialState

    PartialState(cpu=device.type == "cpu")
    if not dist.is_initialized():
        raise UsageError(f"accelerate set up no process group for device {device}; call init_process_group first")


@functools.cache
def _destroy_at_exit() -> None:
    """Destroy the default process group when the interpreter exits, if the script has not (registered once). A
    script that ends after `trainer.save_model()` (as Trainer's own examples do) otherwise leaves the group to the
    interpreter's finalization, where gloo's worker threads may still hold work whose tensors are released without
    a live interpreter: that rank aborts ("terminate called without an active exception", SIGABRT; pytorch PR
    179291 describes it) and the launcher fails the whole run after it succeeded. Destroying the group while the
    interpreter is alive is what a script's own `destroy_process_group()` would do; after it, this does nothing."""
    import atexit

    def destroy() -> None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()

    atexit.register(destroy)


def default_device() -> torch.device:
    """cuda:LOCAL_RANK when CUDA is available, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.distributed.get_node_local_rank(fallback_rank=0))
    return torch.device("cpu")


def _require_launcher(what: str) -> None:
    missing = missing_launcher_env()
    if not torch.distributed.is_available() or missing:
        raise UsageError(
            f"{what} needs torch.distributed: run the script under torchrun or accelerate launch (also for one GPU: "
            f"torchrun --nproc_per_node 1), or call init_process_group first (not set: {', '.join(missing)})"
        )


# ---------------------------------------------------------------------------------- sharding


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks FSDP wraps one by one: modules whose class is in the model's `_no_split_modules`."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = set(getattr(base, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise PrequantError(f"{type(base).__name__} declares no _no_split_modules: cannot tell its decoder layers")
    return layers


def shard_rows(rows: int, coordinate: int, size: int) -> tuple[int, int]:
    """Rows [start, stop) of a dim-0 sharded tensor held by mesh coordinate `coordinate` of `size`: FSDP2's
    `torch.chunk` rule (chunks of ceil(rows / size); the last ranks may hold fewer rows or none)."""
    chunk = -(-rows // size) if rows else 0
    start = min(rows, coordinate * chunk)
    return start, min(rows, start + chunk)


def local_rows(param: torch.Tensor) -> tuple[int, int]:
    """The global dim-0 rows this rank holds of `param` (a DTensor sharded on dim 0, or a plain tensor)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(param, DTensor):
        return 0, param.shape[0] if param.dim() else 1
    start, stop = 0, param.shape[0]
    for dim, placement in enumerate(param.placements):
        if isinstance(placement, Shard) and placement.dim == 0:
            rows = stop - start
            s, e = shard_rows(rows, param.device_mesh.get_local_rank(dim), param.device_mesh.size(dim))
            start, stop = start + s, start + e
        elif not isinstance(placement, Replicate):
            raise PrequantError(f"unsupported placement {placement} (load_for_fsdp fills dim-0 shards)")
    if param.to_local().shape[0] != stop - start:
        raise PrequantError(
            f"FSDP holds {param.to_local().shape[0]} rows of a {tuple(param.shape)} tensor here, expected "
            f"{stop - start}: this torch shards differently from torch.chunk; report it to prequant"
        )
    return start, stop


def packed_layers(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    """(checkpoint prefix, module) of every bitsandbytes Linear4bit in a model, however it is wrapped."""
    from bitsandbytes.nn import Linear4bit

    for name, module in model.named_modules():
        if isinstance(module, Linear4bit):
            prefix = getattr(module, "_prequant_prefix", None) or _checkpoint_prefix(name)
            yield prefix, module


def _checkpoint_prefix(name: str) -> str:
    """A module name in a peft/FSDP1-wrapped model -> the name of its tensors in the checkpoint."""
    parts = [p for p in name.split(".") if p not in ("_fsdp_wrapped_module", "_checkpoint_wrapped_module", "base_layer")]
    name = ".".join(parts)
    return name.removeprefix("base_model.model.")


# ---------------------------------------------------------------------------------- LoRA


def lora_init_value(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """The initial fp32 value of the LoRA parameter `name` (as named in the peft model): B is zero, A is
    peft's default kaiming-uniform (bound 1/sqrt(fan_in)) from a generator seeded by `seed` and the name."""
    if ".lora_B." in name:
        return torch.zeros(shape, dtype=torch.float32)
    g = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
    bound = 1.0 / math.sqrt(shape[1]) if len(shape) > 1 and shape[1] else 0.0
    return torch.empty(shape, dtype=torch.float32).uniform_(-bound, bound, generator=g)


def init_lora_weights(model: torch.nn.Module, seed: int = 0) -> None:
    """Set every LoRA A/B of an unsharded peft model to `lora_init_value`: how a non-sharded reference (or
    transformers' FSDP path, before wrapping) gets exactly the LoRA weights `load_for_fsdp` gives."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_A." in name or ".lora_B." in name:
                p.copy_(lora_init_value(name, tuple(p.shape), seed))


def lora_config(r: int, alpha: int, dropout: float, target_modules: str | list[str]) -> Any:
    """The peft LoraConfig both loaders use."""
    from peft import LoraConfig

    return LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=target_modules, bias="none",
                      task_type="CAUSAL_LM")


def apply_lora(model: torch.nn.Module, r: int, alpha: int, dropout: float, target_modules: str | list[str]) -> Any:
    """`model` wrapped by peft with `lora_config(...)`'s adapters (still on the meta device when the model is); in a
    MoE model with both 4-bit and 16-bit experts, the 16-bit ones get LoRA as peft gives fused experts."""
    from peft import get_peft_model

    config = lora_config(r, alpha, dropout, target_modules)
    lora_on_fused(model, config)
    return get_peft_model(model, config)


def keep_frozen_weights_out_of_state_dict(model: torch.nn.Module) -> None:
    """Make `model.state_dict()` hold its trainable weights and buffers, and each frozen weight as an empty tensor.

    The frozen weights are the checkpoint's own, which training never changes; but whatever saves a state dict
    under FSDP gathers every tensor in it first: `Trainer.save_model` (accelerate's FULL_STATE_DICT) would put
    the whole 4-bit model on rank 0 to write a LoRA adapter of a few MB. The keys stay, with an
    empty value, because torch's `get_model_state_dict(ignore_frozen_params=True)` (accelerate's adapter-only
    checkpoints) pops frozen weights by name; bitsandbytes' entries of a frozen 4-bit weight (absmax, code
    tables, quant-state JSON) are left out."""

    def hook(module: torch.nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
        frozen = {prefix + n: p.dtype for n, p in module.named_parameters() if not p.requires_grad}
        companions = {entry_key(w, c) for w in frozen for c in COMPANIONS}
        for key in list(state_dict):
            if key in frozen:
                state_dict[key] = torch.empty(0, dtype=frozen[key])
            elif key in companions or (split_state_key(key) or ("",))[0] in frozen:
                del state_dict[key]

    model.register_state_dict_post_hook(hook)
