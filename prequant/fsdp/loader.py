"""Load a 4-bit checkpoint for FSDP+QLoRA with each rank reading only its own shard of every tensor.

`transformers.from_pretrained` puts the whole quantized model on every rank's GPU before FSDP shards it: for
Grok-1 (about 165 GB in NF4) that is an out-of-memory on every GPU of a node. `load_for_fsdp` instead:

1. builds the model on the meta device from the checkpoint's config (no memory), with bitsandbytes
   `Linear4bit` layers exactly where the checkpoint holds quantized weights;
2. applies LoRA with peft (still on meta);
3. wraps it with FSDP2 `fully_shard` (each decoder layer, the input embedding, then the root);
4. allocates only the local shards (`to_empty`) and fills them from the memory-mapped safetensors: a rank
   touches only the rows it owns, copied straight to its device; the small quant states (absmax, nested
   absmax, code tables) are read whole on every rank.

Why FSDP2 with packed weights held as uint8: FSDP2 shards per parameter on dim 0, so a rank's shard of a packed
`[n, 1]` weight is one contiguous byte range of the file — nothing to flatten, nothing to broadcast. But FSDP2
gathers a group of same-dtype parameters with `torch._foreach_copy_`, which on CUDA round-trips bf16 through
fp32 and rewrites NaN bit patterns (bitsandbytes issue #1945): packed NF4 bytes stored as bf16 hit such
patterns about once per thousand elements. Holding the packed bytes as a uint8 parameter (frozen, so FSDP2
accepts a non-float dtype) gives the group mixed dtypes, and FSDP2 then gathers everything as raw bytes. The
bytes are the checkpoint's: bitsandbytes reads the same codes from uint8 and from bf16 storage. torch releases
before non-float FSDP2 parameters were supported (2.11, for one) get a two-line fix from `prequant.fsdp.compat`.
"""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

from ..bnb.format import decode_quant_state, state_key
from ..bnb.moe import exact_class
from ..errors import PrequantError, UsageError
from .checkpoint import Checkpoint
from .experts import lora_targets_as_named, per_expert
from .distributed import default_device, ensure_process_group
from .lora import apply_lora, keep_frozen_weights_out_of_state_dict, lora_init_value
from .sharding import decoder_layers, local_rows

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

PackedStorage = Literal["uint8", "checkpoint"]


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
    the Hugging Face Trainer does (`prequant.fsdp.distributed.ensure_process_group`), so `TrainingArguments` may
    be created before or after it. Returns the peft model with `fully_shard` applied to each decoder layer, the
    input embedding and the root; only the LoRA parameters require grad, and `state_dict()` holds them alone
    (frozen weights as empty tensors: `lora.keep_frozen_weights_out_of_state_dict`), so saving gathers the
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
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if device_mesh is None:
        device_mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    if mp_policy is None:
        mp_policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)

    if packed_storage == "uint8":
        from .compat import ensure_nonfloat_params

        ensure_nonfloat_params()  # torch < pytorch#178075 cannot shard frozen uint8 parameters unaided
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


# ----------------------------------------------------------------------------------------- internals


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
        if name in ckpt.tensors:
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
            src = ckpt.packed(prefix, local.dtype) if prefix in ckpt.quantized else ckpt.view(key)
            if tuple(src.shape) != tuple(param.shape):
                raise PrequantError(f"{ckpt.path}: {key} is {tuple(src.shape)} in the file, the model expects "
                                    f"{tuple(param.shape)}; is config.json the checkpoint's own?")
            local.copy_(_read_rows(src, start, stop))
        elif ".lora_A." in name or ".lora_B." in name:
            local.copy_(lora_init_value(name, tuple(param.shape), seed)[start:stop])
        else:
            raise PrequantError(f"parameter {name!r} is neither in the checkpoint nor a LoRA weight")


def _read_rows(src: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Rows [start, stop) of a mapped tensor, still a view: the copy that follows reads only their pages."""
    return src[start:stop]
