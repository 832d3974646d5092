"""Progress on stderr: a tqdm bar counting bytes on a terminal, a periodic one-line status otherwise."""

from __future__ import annotations

import sys
import threading
import time


class Progress:
    """Counts source bytes done. Thread-safe; `close` prints nothing on stdout (results go there)."""

    def __init__(self, total: int, *, enabled: bool = True, interval: float = 10.0, label: str = "converting") -> None:
        self.total, self.done, self.label = total, 0, label
        self._lock = threading.Lock()
        self._start = self._last = time.monotonic()
        self._interval = interval
        self._bar = None
        self._enabled = enabled
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1000, desc=label, file=sys.stderr)

    def advance(self, n: int) -> None:
        with self._lock:
            self.done += n
            if self._bar is not None:
                self._bar.update(n)
            elif self._enabled and time.monotonic() - self._last >= self._interval:
                self._last = time.monotonic()
                print(self.status(), file=sys.stderr, flush=True)

    def status(self) -> str:
        elapsed = max(time.monotonic() - self._start, 1e-9)
        pct = 100 * self.done / self.total if self.total else 100.0
        rate = self.done / elapsed
        eta = (self.total - self.done) / rate if rate else float("inf")
        return (
            f"prequant: {self.label} {self.done / 1e9:.2f}/{self.total / 1e9:.2f} GB ({pct:.0f}%), "
            f"{rate / 1e9:.2f} GB/s, eta {eta:.0f}s"
        )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
