"""A bitsandbytes 4-bit checkpoint opened for slicing, as `load_for_fsdp` and `prequant check-fsdp` read it.

Headers are validated before anything is mapped; the checkpoint itself (which modules have a packed quant
state), not the architecture, says which layers are 4-bit. Tensors are zero-copy views of the mapped files.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ..bnb.format import entry_name, split_state_key
from ..checkpoint.hf_files import CONFIG
from ..checkpoint.reader import TensorReader, scan_files
from ..errors import PrequantError
from ..source.resolve import resolve


class Checkpoint:
    """A bitsandbytes 4-bit checkpoint opened for slicing: headers validated, files memory-mapped on demand."""

    def __init__(self, path: str | Path) -> None:
        src = resolve(str(path))
        if src.format != "safetensors":
            raise PrequantError(f"{src.path}: load_for_fsdp reads safetensors checkpoints; convert it with prequant first")
        self.path = src.path
        self.tensors = {t.name: t for t in scan_files(src.weight_files)}
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
        # them up per layer would scan every name once per layer (seconds per rank for Grok-1's 11k tensors).
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
