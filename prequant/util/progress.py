"""Progress on stderr: a tqdm bar counting bytes on a terminal, a periodic one-line status otherwise.

PREQUANT_PROGRESS picks the form for CI: `json` (one JSON object per line: machine-readable records),
`lines` (the status line even on a terminal), `bar`, or `none`; PREQUANT_PROGRESS_INTERVAL sets the
seconds between records (`settings`).
"""

from __future__ import annotations

import json
import sys
import threading
import time

from .. import settings


class Progress:
    """Counts source bytes done. Thread-safe; `close` prints nothing on stdout (results go there)."""

    def __init__(self, total: int, *, enabled: bool = True, label: str = "converting") -> None:
        self.total, self.done, self.label = total, 0, label
        self._lock = threading.Lock()
        self._start = self._last = time.monotonic()
        mode = settings.progress()
        self._interval = settings.progress_interval()
        self._json = mode == "json"
        self._bar = None
        self._enabled = enabled and mode != "none"
        if self._enabled and (mode == "bar" or (mode == "auto" and sys.stderr.isatty())):
            from tqdm import tqdm

            self._bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1000, desc=label, file=sys.stderr)

    def advance(self, n: int) -> None:
        with self._lock:
            self.done += n
            if self._bar is not None:
                self._bar.update(n)
            elif self._enabled and time.monotonic() - self._last >= self._interval:
                self._last = time.monotonic()
                print(self.record("progress") if self._json else self.status(), file=sys.stderr, flush=True)

    def status(self) -> str:
        elapsed = max(time.monotonic() - self._start, 1e-9)
        pct = 100 * self.done / self.total if self.total else 100.0
        rate = self.done / elapsed
        eta = (self.total - self.done) / rate if rate else float("inf")
        return (
            f"prequant: {self.label} {self.done / 1e9:.2f}/{self.total / 1e9:.2f} GB ({pct:.0f}%), "
            f"{rate / 1e9:.2f} GB/s, eta {eta:.0f}s"
        )

    def record(self, event: str) -> str:
        """One JSON line: what CI tools parse instead of the human status line."""
        elapsed = max(time.monotonic() - self._start, 1e-9)
        rate = self.done / elapsed
        return json.dumps({
            "event": event,
            "task": self.label,
            "done_bytes": self.done,
            "total_bytes": self.total,
            "fraction": round(self.done / self.total, 4) if self.total else 1.0,
            "bytes_per_s": round(rate),
            "elapsed_s": round(elapsed, 3),
            "eta_s": round((self.total - self.done) / rate, 1) if rate else None,
        })

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.close()
        if self._json and self._enabled and exc_type is None:
            print(self.record("done"), file=sys.stderr, flush=True)
