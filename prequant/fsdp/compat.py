"""Workarounds for releases of the libraries under `load_for_fsdp`, each applied only where the installed release
needs it, and each tested.

**torch: frozen uint8 parameters under FSDP2.** `load_for_fsdp` holds packed 4-bit weights as frozen uint8
parameters (see `prequant.fsdp` for why). torch gained support for non-floating-point FSDP2 parameters in
pytorch/pytorch#178075 (issues #177844, #185239); releases before it have two faults with them:

1. `fully_shard` wraps the local shard as `nn.Parameter(dtensor)` and only afterwards copies the original
   `requires_grad`; the constructor's default `requires_grad=True` raises "only Tensors of floating point
   dtype can require gradients" for uint8 before the copy happens.
2. Mixed precision casts every parameter to `param_dtype` for the all-gather, uint8 included: the packed
   codes would be converted as numbers (0..255 -> bf16), which destroys them.

`ensure_nonfloat_params()` fixes exactly these two places, and only on a torch that lacks the fix (detected
from the code itself, not a version number, so backports count). Float parameters behave exactly as before.

**accelerate: FSDP on the CPU.** `ensure_accelerate_cpu_fsdp()`: accelerate (1.15 and earlier) makes a run FSDP
only on accelerators; on gloo ranks it stays MULTI_CPU, and Trainer then wraps an FSDP2 model in DDP, which fails
on its DTensor parameters. Training on gloo ranks (the CPU) gets the state it would get on a GPU, and only when
accelerate left it MULTI_CPU with an FSDP plugin configured.
"""

from __future__ import annotations

import functools
import inspect
import types
from typing import Any

import torch

_PATCHED = "_prequant_nonfloat_params"


def needs_patch() -> dict[str, bool]:
    """Which of the two faults this torch has: {"sharded_param": ..., "param_dtype": ...}."""
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

    def source(fn: Any) -> str:
        try:
            return inspect.getsource(fn)
        except (OSError, TypeError):  # no source shipped: assume the old behaviour, the patch is harmless
            return ""

    return {
        # Fixed torch passes the original flag to the constructor.
        "sharded_param": "requires_grad=param.requires_grad" not in source(FSDPParam._init_sharded_param),
        # Fixed torch clamps param_dtype to None for non-floating-point parameters.
        "param_dtype": "is_floating_point" not in source(FSDPParam.init_dtype_attrs),
    }


def ensure_nonfloat_params(force: bool = False) -> list[str]:
    """Make FSDP2 accept frozen non-floating-point parameters and all-gather them unconverted. Idempotent.

    Returns the names of the fixes applied in this call (empty when torch needs none or they are in place).
    `force` applies both even on a torch that has the upstream fix (tests use it to run the patched code).
    """
    from torch.distributed.fsdp._fully_shard import _fsdp_param

    cls = _fsdp_param.FSDPParam
    applied = getattr(cls, _PATCHED, set())
    faults = needs_patch()
    done = []
    if (force or faults["sharded_param"]) and "sharded_param" not in applied:
        # The module looks `nn.Parameter` up in its own globals: give it a torch.nn whose Parameter defaults
        # `requires_grad` to what the dtype allows. Only this module of torch sees the difference.
        _fsdp_param.nn = _nn_with_nonfloat_parameters(_fsdp_param.nn)
        done.append("sharded_param")
    if (force or faults["param_dtype"]) and "param_dtype" not in applied:
        original = cls.init_dtype_attrs

        @functools.wraps(original)
        def init_dtype_attrs(self: Any, mp_policy: Any) -> None:
            original(self, mp_policy)
            if not self.orig_dtype.is_floating_point:
                self.param_dtype = None  # gather the bytes as they are; mixed precision is for floats

        cls.init_dtype_attrs = init_dtype_attrs
        done.append("param_dtype")
    if done:
        setattr(cls, _PATCHED, applied | set(done))
    return done


class _Parameter(torch.nn.Parameter):
    """`nn.Parameter(data)` whose unspecified `requires_grad` is False for dtypes that cannot have gradients.

    Calling it returns a real `torch.nn.Parameter` (or parameter-flagged tensor subclass, as for DTensor)."""

    def __new__(cls, data: torch.Tensor | None = None, requires_grad: bool | None = None) -> Any:  # type: ignore[misc]
        if requires_grad is None:
            requires_grad = data is None or data.is_floating_point() or data.is_complex()
        return torch.nn.Parameter(data, requires_grad)


def _nn_with_nonfloat_parameters(nn: types.ModuleType) -> types.ModuleType:
    """A stand-in for `torch.nn` that forwards every attribute to it except `Parameter`."""
    if getattr(nn, "Parameter", None) is _Parameter:
        return nn

    class _NN(types.ModuleType):
        def __getattr__(self, name: str) -> Any:
            return getattr(nn, name)

    proxy = _NN(nn.__name__, nn.__doc__)
    proxy.Parameter = _Parameter  # type: ignore[attr-defined]
    return proxy


def ensure_accelerate_cpu_fsdp() -> bool:
    """Let accelerate take its FSDP path on gloo (CPU) ranks, as it does on GPUs. Idempotent; True when applied now.

    `AcceleratorState.__init__` promotes MULTI_GPU (and other accelerator) runs with an FSDP plugin to FSDP: it
    sets the plugin's mixed precision, `fsdp_plugin` and the distributed type, on itself and on `PartialState`.
    Wrapped here: after the original, a state it left MULTI_CPU although a plugin came (Accelerator passes one
    whenever FSDP is asked for, by `TrainingArguments(fsdp=...)` or `ACCELERATE_USE_FSDP`) gets the same. A
    release that does it itself never meets that condition, and nothing changes for GPU runs."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    original = AcceleratorState.__init__
    if getattr(original, _PATCHED, False):
        return False
    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        plugin = signature.bind(self, *args, **kwargs).arguments.get("fsdp_plugin")
        if plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            if self.mixed_precision != "no":
                plugin.set_mixed_precision(self.mixed_precision)
            self.fsdp_plugin = plugin
            self.distributed_type = DistributedType.FSDP
            PartialState().distributed_type = DistributedType.FSDP  # what AcceleratorState() copies back on each call

    setattr(__init__, _PATCHED, True)
    AcceleratorState.__init__ = __init__
    return True
