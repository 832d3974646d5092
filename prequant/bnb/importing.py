"""Importing bitsandbytes for a CUDA conversion, without the compiler it would not use: standard library only.

bitsandbytes' import compiles four of its default (fallback) kernels with `torch.compile` as it defines them, and
`torch.compile` imports torch._dynamo, inductor's compile_fx and sympy: seconds of a conversion's start-up, and
thousands of module files read when the libraries are cold. The first call of any bitsandbytes kernel imports
torch._dynamo anyway (torch.library wraps each custom op's kernel so), but not the compiler.

A conversion calls only bitsandbytes' CUDA kernels (`quantize_4bit`, `quantize_blockwise`), which are not compiled.
So in the `prequant` command's own process (`lean`, from `prequant.__main__`), where no other code uses
bitsandbytes, it is imported with its calls to `torch.compile` answered by the function itself: what bitsandbytes'
own wrapper (`_try_torch_compile`) falls back to when compiling fails, so those kernels run eagerly, to the same
results (`tests/bnb/test_importing.py`). Anywhere else (a library caller's process, which may train with
bitsandbytes afterwards) it is imported as it is.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType

_lean = False
_lock = threading.Lock()


def lean() -> None:
    """This process is the `prequant` command's own: import bitsandbytes without compiling its fallback kernels."""
    global _lean
    _lean = True


def functional() -> ModuleType:
    """`bitsandbytes.functional`, imported lean in a `lean` process where nothing has imported bitsandbytes yet,
    else as it is. Raises ImportError as the import does."""
    with _lock:
        if _lean and "bitsandbytes" not in sys.modules:
            with _compile_answered_for_bitsandbytes():
                import bitsandbytes.functional  # noqa: F401 - imported now, under the block
        from bitsandbytes import functional

    return functional


@contextmanager
def _compile_answered_for_bitsandbytes() -> Iterator[None]:
    """While the block runs, `torch.compile` called from bitsandbytes' own modules returns the function it was given
    (or, as a decorator factory, an identity decorator); any other caller gets torch's."""
    import torch

    real = torch.compile

    def compile(model=None, **kwargs):  # stands in for torch.compile
        if not sys._getframe(1).f_globals.get("__name__", "").startswith("bitsandbytes"):
            return real(model, **kwargs)
        return model if model is not None else _identity

    torch.compile = compile
    try:
        yield
    finally:
        torch.compile = real


def _identity(fn):
    return fn
