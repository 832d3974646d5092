"""`prequant verify` and `prequant upload`: reopen an output and prove it is what prequant wrote (`run.verify`: `check`
the output on its own and `compare` it with the source, filing what they find in a `check.Report`), and publish it
only then (`publish`). `prequant.verify.verify` and `prequant.verify.upload` are imported on first use."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["upload", "verify"]
_LAZY = {"verify": "run", "upload": "publish"}

if TYPE_CHECKING:
    from .publish import upload
    from .run import verify


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'prequant.verify' has no attribute {name!r}")
