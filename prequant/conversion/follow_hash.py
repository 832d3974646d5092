"""A shard's sha256 computed as it is written, for a shard whose header is known before its data.

A shard holding quant-state JSON has a header known only once its tensors are quantized, so it is hashed after it is
sealed (`record.Recorder.on_shard`). A shard of kept tensors only (an embedding or lm_head alone, norms) has its
header fixed by the plan, so its hash follows the writes and is ready when the last byte is: a conversion that ends
with a large kept lm_head does not wait for its hash. The hash reads the file being written (the page cache), never
past what the writer has marked written, and the header from memory; the writer checks, when it seals the shard,
that the header it writes is those bytes.
"""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

from ..checkpoint.manifest import READ_CHUNK


class Cancelled(Exception):
    """The shard was abandoned (the conversion failed): there is no hash to give."""


class FollowHash:
    """sha256 of `prefix` (the file's first bytes, as it will be sealed) then of the file's bytes
    [len(prefix), end) as the writer marks them written (`advance`)."""

    def __init__(self, path: Path, prefix: bytes, end: int) -> None:
        self._fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)  # now: the file is renamed when sealed
        self.prefix, self.end = prefix, end
        self._written = len(prefix)  # the file's bytes known written, contiguous from its start
        self._cond = threading.Condition()
        self._cancelled = False

    def advance(self, upto: int) -> None:
        """The file's bytes up to `upto` are written (the writer's thread)."""
        with self._cond:
            if upto > self._written:
                self._written = upto
                self._cond.notify()

    def cancel(self) -> None:
        """Stop waiting: `run` raises Cancelled."""
        with self._cond:
            self._cancelled = True
            self._cond.notify()

    def run(self) -> str:
        """The hex digest, once every byte is written (a hashing thread; blocks until then)."""
        digest = hashlib.sha256(self.prefix)
        pos, buf = len(self.prefix), bytearray(READ_CHUNK)
        view = memoryview(buf)
        try:
            while pos < self.end:
                with self._cond:
                    # Whole chunks at a time (hashlib releases the GIL on large updates), or the rest at the end.
                    self._cond.wait_for(lambda at=pos: self._cancelled or self._written - at >= min(READ_CHUNK, self.end - at))
                    if self._cancelled:
                        raise Cancelled
                    ready = self._written
                while pos < ready:
                    n = os.preadv(self._fd, [view[: min(READ_CHUNK, ready - pos)]], pos)
                    if n == 0:
                        raise OSError(f"the shard being hashed ends at byte {pos}, before {self.end}")
                    digest.update(view[:n])
                    pos += n
            return digest.hexdigest()
        finally:
            os.close(self._fd)
