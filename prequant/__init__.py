"""prequant: pre-quantize large checkpoints to bitsandbytes 4-bit, streaming one tensor at a time."""

from __future__ import annotations

__version__ = "0.1.0"

# Imported eagerly on purpose: `prequant.convert` must be the function, not the submodule of the
# same name (a lazy import would let the submodule shadow it).
from .convert import Summary, convert  # noqa: E402
from .errors import PrequantError, UsageError  # noqa: E402
from .plan import Plan  # noqa: E402
from .quantize import quantize_tensor  # noqa: E402

__all__ = ["Plan", "PrequantError", "Summary", "UsageError", "__version__", "convert", "quantize_tensor"]
