"""prequant: pre-quantize large checkpoints to bitsandbytes 4-bit, streaming one tensor at a time.

The package, one subpackage per job, lower layers never importing upper ones:
`util` < `checkpoint`, `hub` < `bnb` < `source` < `verify`, `fsdp` < `conversion` < `merging` < `cli`.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from ._version import __version__
from .errors import PrequantError, UsageError

__all__ = ["ConvertOptions", "Plan", "PrequantError", "Summary", "UsageError", "__version__", "change_storage",
           "convert", "load_for_fsdp", "load_model", "merge", "quantize_tensor"]

# Imported on first use: `import prequant` (and so the CLI, which starts reading the disk before it
# pays for torch) must stay cheap.
_LAZY = {
    "convert": "conversion.run",
    "ConvertOptions": "conversion.options",
    "Summary": "conversion.summary",
    "Plan": "conversion.plan",
    "quantize_tensor": "bnb.quantize",
    "load_for_fsdp": "fsdp.loader",
    "change_storage": "conversion.storage",
    "load_model": "bnb.moe",
    "merge": "merging.run",
}

if TYPE_CHECKING:
    from .bnb.moe import load_model
    from .bnb.quantize import quantize_tensor
    from .conversion.options import ConvertOptions
    from .conversion.plan import Plan
    from .conversion.run import convert
    from .conversion.storage import change_storage
    from .conversion.summary import Summary
    from .fsdp.loader import load_for_fsdp
    from .merging.run import merge


# bitsandbytes, imported on a CPU with AVX512-BF16, tries to fetch an optional CPU inference kernel from the Hub and
# logs "Failed to load CPU gemm_4bit_forward from kernels-community: ..." when it cannot (offline, or `kernels`
# missing), then runs its built-in kernel: the same results. That line comes once per process, so once per rank of
# every load; in a process that imports prequant (the CLI, check-fsdp's ranks, a script using load_for_fsdp) that
# one message of that logger is dropped, and everything else bitsandbytes logs passes (docs/loading.md).
_BNB_CPU_LOGGER = "bitsandbytes.backends.cpu.ops"
_BNB_CPU_KERNEL_NOTE = "Failed to load CPU gemm_4bit_forward from kernels-community"


def _not_the_cpu_kernel_note(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith(_BNB_CPU_KERNEL_NOTE)


logging.getLogger(_BNB_CPU_LOGGER).addFilter(_not_the_cpu_kernel_note)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'prequant' has no attribute {name!r}")
