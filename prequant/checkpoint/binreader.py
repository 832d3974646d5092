"""PyTorch pickle shards (`pytorch_model-*.bin`), read lazily and safely.

Only `torch.load(..., weights_only=True, mmap=True)` ever unpickles them: torch's restricted unpickler
refuses any object that is not a tensor or plain container, so a malicious pickle is rejected before any
of its code can run, and tensors stay views of a private file mapping (page cache, not anonymous memory).
"""

from __future__ import annotations

import math
import pickle
import zipfile
from pathlib import Path

import torch

from ..errors import PrequantError
from .dtypes import TORCH_TO_SAFETENSORS


def load(path: Path) -> dict[str, torch.Tensor]:
    """The shard's tensors, memory-mapped; refused with a one-line error when unsafe or corrupt."""
    if not zipfile.is_zipfile(path):
        # Pre-1.6 torch.save files cannot be memory-mapped and need a full unpickle of the data.
        raise PrequantError(
            f"{path}: not a zip-format PyTorch checkpoint (legacy torch.save or corrupt); re-save it with a current "
            "torch or convert it to safetensors first"
        )
    try:
        state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except pickle.UnpicklingError as e:
        raise refused(path, e) from e
    except (RuntimeError, OSError, EOFError, ValueError, zipfile.BadZipFile) as e:
        raise PrequantError(f"{path}: cannot read this PyTorch checkpoint ({type(e).__name__}); re-download it") from e
    return check_state(path, state)


def refused(label: object, e: pickle.UnpicklingError) -> PrequantError:
    """The error for a pickle torch's restricted unpickler refused (it ran nothing from it)."""
    return PrequantError(
        f"{label}: refused to unpickle: the file holds objects other than tensors ({_what(e)}); it may be "
        "malicious, nothing from it was run; get the weights as safetensors"
    )


def _what(e: pickle.UnpicklingError) -> str:
    """What torch's restricted unpickler refused, without its advice: torch suggests re-running with
    `weights_only=False` or allow-listing the global, which for an untrusted file means running its code."""
    paragraphs = [p.strip() for p in str(e).split("\n\n") if p.strip()]
    facts = [p for p in paragraphs if "weights_only" not in p] or paragraphs or [type(e).__name__]
    first = facts[0].removeprefix("WeightsUnpickler error: ").split(". ")[0].rstrip(".")
    return " ".join(first.split())[:200]


def check_state(label: object, state: object) -> dict[str, torch.Tensor]:
    """What was unpickled must be a state dict of tensors safetensors can store (`label` names the file)."""
    if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()):
        raise PrequantError(f"{label}: expected a mapping of names to tensors (a state dict); this file holds something else")
    for name, t in state.items():
        if t.dtype not in TORCH_TO_SAFETENSORS:
            raise PrequantError(f"{label}: tensor {name!r} has dtype {t.dtype}, which safetensors cannot store")
    return state


def describe(path: Path, state: dict[str, torch.Tensor]) -> list[tuple[str, str, tuple[int, ...], int]]:
    """(name, safetensors dtype, shape, nbytes) for each tensor, in the file's order."""
    return [
        (name, TORCH_TO_SAFETENSORS[t.dtype], tuple(t.shape), math.prod(t.shape) * t.element_size())
        for name, t in state.items()
    ]
