"""prequant: pre-quantize large checkpoints to bitsandbytes 4-bit, streaming one tensor at a time.

The package, one subpackage per job, lower layers never importing upper ones:
`util` < `checkpoint`, `hub` < `bnb` < `source` < `verify`, `fsdp` < `conversion` < `cli`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._version import __version__
from .errors import PrequantError, UsageError

__all__ = ["ConvertOptions", "Plan", "PrequantError", "Summary", "UsageError", "__version__", "convert",
           "load_for_fsdp", "load_model", "quantize_tensor"]

# Imported on first use: `import prequant` (and so the CLI, which starts reading the disk before it
# pays for torch) must stay cheap.
_LAZY = {
    "convert": "conversion.run",
    "ConvertOptions": "conversion.options",
    "Summary": "conversion.summary",
    "Plan": "conversion.plan",
    "quantize_tensor": "bnb.quantize",
    "load_for_fsdp": "fsdp.loader",
    "load_model": "bnb.moe",
}

if TYPE_CHECKING:
    from .bnb.moe import load_model
    from .bnb.quantize import quantize_tensor
    from .conversion.options import ConvertOptions
    from .conversion.plan import Plan
    from .conversion.run import convert
    from .conversion.summary import Summary
    from .fsdp.loader import load_for_fsdp


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'prequant' has no attribute {name!r}")
