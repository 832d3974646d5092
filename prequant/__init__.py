"""prequant: pre-quantize large checkpoints to bitsandbytes 4-bit, streaming one tensor at a time."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .errors import PrequantError, UsageError

__version__ = "0.1.0"
__all__ = ["PrequantError", "UsageError", "__version__", "convert", "quantize_tensor"]

if TYPE_CHECKING:
    from .convert import convert
    from .quantize import quantize_tensor


def __getattr__(name: str) -> Any:
    # Lazy: `import prequant` (and the CLI's --help) must not pay for importing torch.
    if name == "convert":
        from .convert import convert

        return convert
    if name == "quantize_tensor":
        from .quantize import quantize_tensor

        return quantize_tensor
    raise AttributeError(f"module 'prequant' has no attribute {name!r}")
