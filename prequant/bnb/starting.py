"""A conversion on CUDA that does not wait for CUDA: the CPU quantizes while CUDA and bitsandbytes start.

CUDA's context and bitsandbytes' import take seconds: on the GPU machine, libraries warm, a 16 GB Llama's
quantizer was ready 2.7 s after torch's import (PREQUANT_TRACE `imported` 2.09 s, `quantizer-ready` 4.81 s,
`scripts/bench/convert.py --size-gb 16 --shape llama --device cuda --warm-libraries`, 2026-12-02), and the pipeline, bound
by the disk's writes from then on, never won them back (16.9 s against a floor of 11.9 s). So `Starting` builds the
CUDA quantizer on a thread and the pipeline runs at once: kept tensors are copied as always, and tensors to
quantize are read as memory-mapped views and quantized by prequant's CPU kernel, whose bytes are bitsandbytes' CUDA
bytes (the golden and CUDA-equality tests), until the CUDA quantizer is ready; from then on the reader loads each
tensor onto the GPU. Which tensors went where depends on timing; the bytes do not.

Not when the process started with its libraries cold (`conversion.run` decides, from the CLI's start-up check): CUDA's
start then reads its libraries page fault by page fault, and beside the pipeline's reads and writes it took 29 s
(`cuda-ready` 31.96 s, a 33 GB Grok-shaped checkpoint, `scripts/bench/convert.py --size-gb 33 --shape grok --device cuda`,
everything cold, 2026-12-02) where it took 4-12 s with the pipeline waiting for it (the session before's leases, and
the same command with the pipeline waiting). PREQUANT_CPU_WHILE_CUDA_STARTS=0 waits for CUDA before the
first tensor too (the GPU tests of the CUDA path use it, so that every tensor there goes through bitsandbytes'
kernel); =1 quantizes on the CPU meanwhile even when the libraries are cold; unset or `auto`, the rule above.

Quantizing meanwhile after a cold start buys nothing where the disk is the bound: the cold start reads its libraries
from the same disk as the source. The pipeline waiting for CUDA took 23.54 / 22.89 s, =1 23.40 / 23.07 s, and the
CPU worker processes (tried, then removed: slower, and 6.8-7.0 GiB RssAnon across the process tree) 24.08 / 24.43 s,
on a Grok-shaped 33 GB checkpoint (two runs each, interleaved, one floor of 19.0 s; `scripts/bench/window.py --size-gb 33
--shape grok --devices cuda --windows 0 --env PREQUANT_CPU_WHILE_CUDA_STARTS=auto,1,workers --repeats 2`, an H100
machine, 2026-12-05, docs/performance.md). So a cold start still waits.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import threading
from collections.abc import Callable

import torch

from ..util import trace
from .format import Settings
from .quantize import Quantizer, no_bitsandbytes, pick_device, uses_cuda

ENV = "PREQUANT_CPU_WHILE_CUDA_STARTS"
log = logging.getLogger(__name__)


class Starting:
    """The quantizers of a CUDA conversion whose CUDA quantizer is still starting (on a thread of its own)."""

    device_type = "cuda"

    def __init__(self, settings: Settings, start: Callable[[], Quantizer]) -> None:
        """`start()` builds the CUDA quantizer (it runs on the thread); meanwhile `now()` is the CPU's."""
        self.settings = settings
        self.cpu = Quantizer(settings, torch.device("cpu"))
        self._cuda: Quantizer | None = None
        self._error: BaseException | None = None
        self._done = threading.Event()
        self.early = 0  # tensors handed to the CPU while CUDA started
        # Not a daemon: the process' exit waits for it rather than tearing the interpreter down under a thread
        # that is inside the CUDA driver.
        self._thread = threading.Thread(target=self._start, args=(start,), name="prequant-cuda-start")
        self._thread.start()

    def _start(self, start: Callable[[], Quantizer]) -> None:
        try:
            self._cuda = start()
        except BaseException as e:  # noqa: BLE001 - raised where the pipeline next asks (now, on, wait)
            self._error = e
        finally:
            trace.mark("cuda-ready")
            self._done.set()

    def now(self) -> Quantizer:
        """The quantizer for the next tensor read: the CUDA one once it is ready, else the CPU's."""
        if self._done.is_set():
            return self.wait()
        self.early += 1
        return self.cpu

    def on(self, device: torch.device) -> Quantizer:
        """The quantizer for a tensor on `device` (one on the GPU was read for the CUDA quantizer: it is ready)."""
        return self.cpu if device.type == "cpu" else self.wait()

    def wait(self) -> Quantizer:
        """The CUDA quantizer, once started; raises what its start raised."""
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._cuda  # type: ignore[return-value]

    @property
    def device(self) -> torch.device:
        """The CUDA device (waits for its start)."""
        return self.wait().device


def meanwhile(cold: bool) -> bool:
    """Whether a CUDA conversion quantizes on the CPU while CUDA starts. PREQUANT_CPU_WHILE_CUDA_STARTS says: 0 no,
    1 yes; unset or auto, yes unless the process started with its libraries `cold` (module docstring)."""
    given = os.environ.get(ENV, "auto")
    choice = given.strip().lower()
    if choice not in ("", "auto", "0", "1"):
        # A typo must not pass for a choice: said once per conversion, as the other PREQUANT_ variables do.
        log.warning("%s=%r is none of 0, 1 or auto; using auto", ENV, given)
    if choice in ("0", "1"):
        return choice == "1"
    return not cold


def quantizer(settings: Settings, device: str, weight_bytes: int | None = None, *,
              cold: bool = False) -> Quantizer | Starting:  # fmt: skip
    """What converts on `device` (`bnb.quantize.pick_device`): on CUDA, a `Starting` that quantizes on the CPU
    meanwhile where `meanwhile(cold)` says so, or, where it says to wait or CUDA is running already in this process,
    the CUDA `Quantizer`, started here; else the CPU's `Quantizer`. Refuses a CUDA conversion without bitsandbytes
    at once, before anything is written."""
    if not uses_cuda(device, weight_bytes):
        return Quantizer(settings, torch.device("cpu"))
    if importlib.util.find_spec("bitsandbytes") is None:
        raise no_bitsandbytes("no module named 'bitsandbytes'")
    if not meanwhile(cold) or torch.cuda.is_initialized():
        return Quantizer(settings, pick_device(device, weight_bytes))
    return Starting(settings, lambda: Quantizer(settings, pick_device(device, weight_bytes)))
