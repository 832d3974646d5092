"""One tensor in, the checkpoint entries of its 4-bit form out; the backend is chosen once.

On a CUDA device the work is bitsandbytes' own kernel, called as transformers calls it, so the bytes are
the reference by construction. On the CPU it is prequant's kernel (`prequant.kernels.cpu`), which
reproduces the CUDA bytes (bitsandbytes' CPU path does not). What the entries hold is `bnb.format`'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .. import settings as env
from ..checkpoint.dtypes import NAMED, TORCH_TO_SAFETENSORS, torch_name
from ..errors import PrequantError, UsageError, flag, skipping, spelled
from ..util import signals
from . import cuda, importing
from .format import NESTED_BLOCKSIZE, Settings, encode_quant_state, packed_length, quant_state

# `--device auto` quantizes checkpoints lighter than this on the CPU even where there is a GPU: CUDA and
# bitsandbytes take seconds to start, more than the CPU kernel takes for this much, and the bytes are the same.
AUTO_CUDA_FROM = 256 * 2**20
# bitsandbytes' CUDA kernels index elements with int32: bigger tensors go through in block-aligned pieces.
MAX_KERNEL_ELEMENTS = 2**31 - 2**20


def check_device(device: str) -> None:
    """Refuse a device a conversion cannot use (its spelling; for CUDA, that the GPU exists) without initialising
    CUDA (`is_available` and `device_count` ask the driver, not a context), so a dry run refuses what a run would.
    The refusal names the option as the caller writes it: `--device cuda` or `device='cuda'`."""
    if device == "auto":
        return
    said = spelled("device", device)
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError) as e:
        raise UsageError(f"{said} is not a device; use auto, cpu or cuda[:N]") from e
    if dev.type == "cpu":
        return
    if dev.type != "cuda":
        raise UsageError(f"{said} is not supported; use auto, cpu or cuda[:N]")
    if not torch.cuda.is_available():
        raise UsageError(f"{said} asked for, but no CUDA GPU is visible; use {spelled('device', 'cpu')}")
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        raise UsageError(f"{said}: only {torch.cuda.device_count()} GPU(s) visible")


def uses_cuda(device: str, weight_bytes: int | None = None) -> bool:
    """Whether `pick_device` will answer a CUDA device, known without starting CUDA (no context is made)."""
    check_device(device)
    if device == "auto":
        # decided before CUDA is asked anything for a light checkpoint: that is the point
        return not (weight_bytes is not None and weight_bytes < AUTO_CUDA_FROM) and torch.cuda.is_available()
    return torch.device(device).type == "cuda"


def pick_device(device: str, weight_bytes: int | None = None) -> torch.device:
    """'auto' -> the current CUDA device when there is one and the checkpoint's weights (`weight_bytes`, when
    known) weigh at least AUTO_CUDA_FROM, else the CPU; 'cuda[:N]' must exist. A CUDA answer starts CUDA."""
    if not uses_cuda(device, weight_bytes):
        return torch.device("cpu")
    dev = torch.device("cuda" if device == "auto" else device)
    return torch.device("cuda", dev.index if dev.index is not None else torch.cuda.current_device())


def no_bitsandbytes(reason: object) -> PrequantError:
    """The error for a CUDA conversion without an importable bitsandbytes."""
    return PrequantError(
        f"bitsandbytes is not importable ({reason}); install it (pip install bitsandbytes) or use "
        f"{spelled('device', 'cpu')}"
    )


@dataclass
class Quantizer:
    """Quantizes tensors with fixed settings on one device; `__call__` returns entries on that device."""

    settings: Settings
    device: torch.device

    def __post_init__(self) -> None:
        self._tables_on_host: list[tuple[torch.Tensor, torch.Tensor]] = []  # (device table, its host copy)
        if self.device.type == "cuda":
            try:
                with signals.deferred():  # a compiled library's import (see util.signals)
                    importing.functional()
            except ImportError as e:
                raise no_bitsandbytes(e) from e
            _limit_cuda_memory(self.device)
            self._code = cuda.code_4bit(self.settings.quant_type, self.device)
            self._dynamic = cuda.dynamic_code(self.device)
            self._tables_on_host = [(t, t.cpu()) for t in (self._code, self._dynamic)]
            # The kernels' first call loads them onto the device: paid here, where the quantizer is built (on a
            # thread of its own: `bnb.starting`), rather than by the pipeline's first tensor.
            self(torch.ones(4, 2 * self.settings.blocksize, dtype=torch.bfloat16, device=self.device), "warm-up")
        else:
            from .kernels import cpu

            self._cpu = cpu

    def table_on_host(self, t: torch.Tensor) -> torch.Tensor | None:
        """A host copy of `t` when it is one of the code tables every tensor's entries share (quant_map,
        nested_quant_map): copied once per run instead of once per tensor. None for any other tensor."""
        return next((host for table, host in self._tables_on_host if t is table), None)

    @property
    def device_type(self) -> str:
        """'cpu' or 'cuda': where the conversion runs."""
        return self.device.type

    def __call__(self, x: torch.Tensor, name: str = "tensor") -> dict[str, torch.Tensor]:
        """The entries that follow `name` in a checkpoint: weight, absmax, quant_map, ... quant_state."""
        s = self.settings
        shape, dtype = tuple(x.shape), x.dtype
        finite: torch.Tensor | bool = True  # the CPU kernel refuses non-finite values itself
        if self.device.type == "cuda":
            packed, absmax, code, finite = self._cuda_4bit(x)
        else:
            try:
                packed, absmax = self._cpu.quantize_4bit(x, quant_type=s.quant_type, blocksize=s.blocksize)
            except self._cpu.NonFiniteError as e:
                raise _non_finite(name) from e
            code = self._cpu.code_table(s.quant_type)
        out = {"weight": _as_storage(packed, NAMED[s.quant_storage], x.numel()), "absmax": absmax, "quant_map": code}
        offset = None
        if s.double_quant:
            codes, nested_absmax, nested_map, offset = self._nested(absmax)
            out.update(absmax=codes, nested_absmax=nested_absmax, nested_quant_map=nested_map)
        if isinstance(finite, torch.Tensor):  # the one wait for the GPU per tensor: both scalars at once
            finite, offset = _on_host(finite, offset)
        if not finite:
            raise _non_finite(name)
        if offset is not None and not math.isfinite(offset):  # float32's sum of block scales near its maximum
            raise PrequantError(
                f"tensor {name!r}: its block scales (up to {float(absmax.max()):.3g}) are too large for double "
                "quantization (their mean overflows float32, and the weight would load as NaN); pass "
                f"{flag('double_quant', False)}, or keep it unquantized with {skipping(name.removesuffix('.weight'))}"
            )
        state = quant_state(s.quant_type, s.blocksize, torch_name(dtype), list(shape), offset)
        out[s.state_entry] = torch.tensor(list(encode_quant_state(state)), dtype=torch.uint8)
        return out

    def _cuda_4bit(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Packed codes, absmax and code table, and whether every value is finite (a flag on the GPU, read with
        the double quant's offset: bitsandbytes' kernel ignores NaN in its absmax (fmaxf), so it is checked
        explicitly, in one cheap GPU pass)."""
        s = self.settings
        x = x.to(self.device, non_blocking=True).contiguous().view(-1)
        finite = torch.isfinite(x).all()
        # Pieces are whole blocks and an even element count, so bytes and absmax simply concatenate.
        step = MAX_KERNEL_ELEMENTS - MAX_KERNEL_ELEMENTS % (2 * s.blocksize)
        pieces = [cuda.quantize_4bit(x[start : start + step], s.blocksize, s.quant_type)
                  for start in range(0, max(x.numel(), 1), step)]
        if len(pieces) == 1:
            return *pieces[0], self._code, finite
        return torch.cat([p for p, _ in pieces]), torch.cat([a for _, a in pieces]), self._code, finite

    def _nested(self, absmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float | torch.Tensor]:
        """Double quantization: 8-bit blockwise codes of absmax minus its mean, over the whole tensor (on a GPU
        the mean stays there, a float32 scalar that `__call__` reads)."""
        if self.device.type == "cuda":
            offset = absmax.mean()
            codes, nested_absmax = cuda.quantize_blockwise(absmax - offset, self._dynamic, NESTED_BLOCKSIZE)
            return codes, nested_absmax, self._dynamic, offset
        codes, nested_absmax, offset = self._cpu.quantize_nested(absmax, blocksize=NESTED_BLOCKSIZE)
        return codes, nested_absmax, self._cpu.dynamic_map(), offset


# PREQUANT_CUDA_MEMORY_LIMIT caps what torch may allocate on the GPU: a conversion then proves it fits a smaller
# GPU (torch raises out-of-memory past the cap rather than using more).
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def _limit_cuda_memory(device: torch.device) -> None:
    """Apply PREQUANT_CUDA_MEMORY_LIMIT through torch.cuda.set_per_process_memory_fraction (per device)."""
    text = env.cuda_memory_limit()
    if text is None:
        return
    number, unit = text.rstrip("BbIiKkMmGg"), text[len(text.rstrip("BbIiKkMmGg")) :].lower()
    try:
        limit = float(number) * _UNITS[unit]
    except (ValueError, KeyError):
        raise UsageError(f"{env.CUDA_MEMORY_LIMIT}={text!r} is not a size; use e.g. 8GiB, 8000MB or bytes") from None
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, limit / total), device)


def _on_host(finite: torch.Tensor, offset: float | torch.Tensor | None) -> tuple[bool, float | None]:
    """A GPU flag and the double quant's float32 offset (a tensor there) as Python values, in one copy: each
    copy waits for the GPU, which then idles until this thread queues the next tensor's kernels."""
    if not isinstance(offset, torch.Tensor):
        return bool(finite), offset
    flag, value = torch.stack([finite.to(offset.dtype), offset]).tolist()
    return flag != 0, value


def _as_storage(packed: torch.Tensor, storage: torch.dtype, n: int) -> torch.Tensor:
    """Packed codes as bitsandbytes shapes them: [packed_length(n), 1] of the storage dtype.

    Only a view of the bytes: packed codes must never pass through a float operation."""
    count = packed_length(n, TORCH_TO_SAFETENSORS[storage])
    return packed.view(-1)[: count * storage.itemsize].view(storage).view(count, 1)


def _non_finite(name: str) -> PrequantError:
    module = name.removesuffix(".weight")
    return PrequantError(
        f"tensor {name!r} contains NaN or Inf values, which would poison its 4-bit statistics; fix the source "
        f"checkpoint, or keep that module unquantized with {skipping(module)}"
    )


def quantize_tensor(
    tensor: torch.Tensor,
    *,
    quant_type: str = "nf4",
    blocksize: int = 64,
    double_quant: bool = True,
    quant_storage: torch.dtype = torch.uint8,
    device: str = "cpu",
    name: str = "tensor",
) -> dict[str, torch.Tensor]:
    """Quantize one tensor to bitsandbytes 4-bit and return its checkpoint entries, on the CPU.

    Keys: "weight" (packed codes viewed as `quant_storage`), "absmax", "quant_map", with double quant
    "nested_absmax" and "nested_quant_map", and "quant_state.bitsandbytes__nf4" (or "__fp4"). `device`
    "cuda[:N]" uses bitsandbytes' CUDA kernel; "cpu" prequant's CPU kernel (same bytes).
    """
    storage = {v: k for k, v in NAMED.items()}.get(quant_storage)
    if storage is None:
        raise UsageError(f"quant_storage {quant_storage} is not supported; use torch.uint8, bfloat16, float16 or float32")
    settings = Settings(quant_type, double_quant, blocksize, "bfloat16", storage)
    entries = Quantizer(settings, pick_device(device))(tensor, name)
    return {k: v.cpu() for k, v in entries.items()}
