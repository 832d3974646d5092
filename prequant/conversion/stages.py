"""The pipeline's stages: bounded queues between its threads that give up as soon as any thread has failed."""

from __future__ import annotations

import queue
import threading

from ..util import trace

IN_FLIGHT = 2  # tensors queued between stages


class Stop(Exception):
    """Another stage failed; this one stops quietly and the first error is raised."""


class Stage:
    """A bounded queue that gives up as soon as any stage has failed."""

    def __init__(self, failed: threading.Event, name: str, size: int = IN_FLIGHT) -> None:
        self._put_label, self._get_label = f"{name}-put-wait", f"{name}-get-wait"
        self._q: queue.Queue = queue.Queue(maxsize=size)
        self._failed = failed

    def put(self, item: object) -> None:
        with trace.busy(self._put_label):
            self._put(item)

    def get(self) -> object:
        with trace.busy(self._get_label):
            return self._get()

    def offer(self, item: object) -> bool:
        """Put `item` if there is room now; whether it was put (a stage that has work of its own to go on with
        rather than wait)."""
        if self._failed.is_set():
            raise Stop
        try:
            self._q.put_nowait(item)
            return True
        except queue.Full:
            return False

    def _put(self, item: object) -> None:
        while True:
            if self._failed.is_set():
                raise Stop
            try:
                self._q.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def _get(self) -> object:
        while True:
            if self._failed.is_set():
                raise Stop
            try:
                return self._q.get(timeout=0.1)
            except queue.Empty:
                continue


END = object()  # the last item a stage passes on
