"""Importing bitsandbytes for a CUDA conversion, without the compiler it would not use: standard library only.

bitsandbytes' import compiles four of its default (fallback) kernels with `torch.compile` as it defines them, and
`torch.compile` imports torch._dynamo, inductor's compile_fx and sympy. On the GPU machine bitsandbytes' import was
2.6 s of the 5.0 s from a process' start to its first CUDA quantization with warm libraries (torch 1.9 s, CUDA
0.4 s), and a cold start read 4914 module files (`scripts/probe_cold_cuda.py`, 2026-12-02; a one-off probe removed
since: `git show 4a7423d:scripts/probe_cold_cuda.py`). The first call of any bitsandbytes kernel imports
torch._dynamo anyway (torch.library wraps each custom op's kernel so), but not the compiler: on the 2-core CPU
machine (a one-off script timing `functional()` and a first `quantize_4bit`, two runs each way, 2026-12-02), import
and first call took 2.2-2.9 s and imported 2588 modules; without those compilations 1.3-1.5 s and 1994 modules. On
the GPU machine, from a process' start to its first quantization: warm 4.70 s plain, 3.39-3.62 s lean; from a
dropped page cache 6.17 s lean (6.74 s plain, an earlier lease; that probe with --lean-only). In a cold Grok-shaped
conversion CUDA and bitsandbytes were then ready 2.3 s after torch's import
(`scripts/bench/convert.py --size-gb 33 --shape grok --device cuda`).

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
