"""The quantizer, built on a thread: on CUDA, bitsandbytes' import, the CUDA context and the kernels' first load
take seconds, which the caller spends making the plan meanwhile; the pipeline waits for it before its first tensor."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from ..util import trace
from .format import Settings
from .quantize import Quantizer, no_bitsandbytes, pick_device, uses_cuda


class Starting:
    """A quantizer being built on a thread of its own (`build`); `wait()` gives it, or raises what building it
    raised."""

    device_type = "cuda"

    def __init__(self, settings: Settings, build: Callable[[], Quantizer]) -> None:
        self.settings = settings
        # A pool's thread is joined at the process' exit, never torn down while it is inside the CUDA driver.
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prequant-quantizer")
        self._future = pool.submit(build)
        self._future.add_done_callback(lambda _: trace.mark("cuda-ready"))
        pool.shutdown(wait=False)

    def wait(self) -> Quantizer:
        """The quantizer, once built; raises what building it raised."""
        return self._future.result()

    @property
    def device(self) -> torch.device:
        """The CUDA device (waits for the quantizer)."""
        return self.wait().device


def quantizer(settings: Settings, device: str, weight_bytes: int | None = None) -> Quantizer | Starting:
    """What converts on `device` (`bnb.quantize.pick_device`): on CUDA, a `Starting` building the CUDA `Quantizer`
    on a thread; else the CPU's `Quantizer`. Refuses a CUDA conversion without bitsandbytes at once, before
    anything is written."""
    if not uses_cuda(device, weight_bytes):
        return Quantizer(settings, torch.device("cpu"))
    if importlib.util.find_spec("bitsandbytes") is None:
        raise no_bitsandbytes("no module named 'bitsandbytes'")
    return Starting(settings, lambda: Quantizer(settings, pick_device(device, weight_bytes)))


def after_start(quantizer: Quantizer | Starting, call: Callable[[], None]) -> None:
    """`call()` once the quantizer is built (or failed to be), on the thread that built it: work that would compete
    with CUDA's start for the interpreter (imports) waits for it; with the CPU's quantizer, or one built, at once."""
    if isinstance(quantizer, Starting):
        quantizer._future.add_done_callback(lambda _: call())
    else:
        call()


def ready(quantizer: Quantizer | Starting) -> Quantizer:
    """The quantizer itself, once built."""
    return quantizer.wait() if isinstance(quantizer, Starting) else quantizer
