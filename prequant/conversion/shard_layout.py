"""Where everything of one output shard goes, fixed before any data: the writer's layout, also what the plan
predicts sizes from and what a storage change lays its copy out by.

Data is ordered by element size, then name, as safetensors' own writer orders it, which keeps every tensor
aligned. The quant-state JSON blobs (their length is known only once quantized: the text holds a float) go at
the end of the data section; the header gets the room the longest conceivable blobs would need, padded with
spaces as the safetensors format allows, so its size, and every data offset, is known from the plan alone.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Protocol

from ..checkpoint.dtypes import itemsize

_PLACEHOLDER_LEN = 9_999_999  # longer than any quant-state JSON: makes the reserved header big enough


class Entry(Protocol):
    """One tensor of a shard (the plan's OutTensor): `shape` None for a quant-state JSON."""

    key: str
    dtype: str
    shape: tuple[int, ...] | None

    @property
    def nbytes(self) -> int: ...


class ShardLayout:
    """The offsets of a shard's fixed-size tensors and the size of its header (8-byte length + reserved JSON)."""

    def __init__(self, entries: Iterable[Entry], metadata: dict[str, str] | None = None) -> None:
        entries = list(entries)
        self.metadata = metadata or {"format": "pt"}
        self.fixed = sorted((e for e in entries if e.shape is not None), key=lambda e: (-itemsize(e.dtype), e.key))
        self.variable = sorted((e for e in entries if e.shape is None), key=lambda e: e.key)
        self.offsets: dict[str, tuple[int, int]] = {}
        pos = 0
        for e in self.fixed:
            self.offsets[e.key] = (pos, pos + e.nbytes)
            pos += e.nbytes
        self.fixed_end = pos
        longest = self.header({e.key: _PLACEHOLDER_LEN for e in self.variable})
        self.reserved = _round8(len(longest))
        self.data_start = 8 + self.reserved  # also the bytes a shard spends before its data

    def header(self, variable_sizes: dict[str, int]) -> bytes:
        """The header JSON once the variable-size tensors' sizes are known (unpadded)."""
        header: dict[str, object] = {"__metadata__": self.metadata}
        for e in self.fixed:
            header[e.key] = {"dtype": e.dtype, "shape": list(e.shape or ()), "data_offsets": list(self.offsets[e.key])}
        pos = self.fixed_end
        for e in self.variable:
            size = variable_sizes[e.key]
            header[e.key] = {"dtype": e.dtype, "shape": [size], "data_offsets": [pos, pos + size]}
            pos += size
        return json.dumps(header, separators=(",", ":")).encode()


def _round8(n: int) -> int:
    return (n + 7) // 8 * 8
