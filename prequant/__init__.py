"""prequant: pre-quantize large checkpoints to bitsandbytes 4-bit, streaming one tensor at a time."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .errors import PrequantError, UsageError

__version__ = "0.1.0"
__all__ = ["Plan", "PrequantError", "Summary", "UsageError", "__version__", "convert", "load_for_fsdp",
           "quantize_tensor"]

# Imported on first use: `import prequant` (and so the CLI, which starts reading the disk before it
# pays for torch) must stay cheap.
_LAZY = {
    "convert": "converter",
    "Summary": "converter",
    "Plan": "plan",
    "quantize_tensor": "quantize",
    "load_for_fsdp": "fsdp",
}

if TYPE_CHECKING:
    from .converter import Summary, convert
    from .fsdp import load_for_fsdp
    from .plan import Plan
    from .quantize import quantize_tensor


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'prequant' has no attribute {name!r}")
