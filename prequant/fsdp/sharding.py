"""How FSDP2 lays out a model across ranks, as `load_for_fsdp` fills it: which modules are wrapped one by one,
which rows of a dim-0 sharded tensor a rank holds, and where the 4-bit layers are however the model is wrapped."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ..errors import PrequantError


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
