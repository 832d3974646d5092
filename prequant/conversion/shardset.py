"""The output shards of one run, on the writer thread: each opened on its first tensor, finalized (hashed,
synced, renamed) when its last tensor is written, and every finished tensor and shard journaled for --resume.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

from ..util import failpoints
from .journal import Journal
from .follow_hash import FollowHash
from .plan import Plan, Step
from .writer import ShardWriter


@dataclass(frozen=True)
class FileSlice:
    """Bytes of an open source file: a tensor kept as it is, copied file to file by the kernel."""

    fd: int
    offset: int
    nbytes: int


class ShardSet:
    """The open shard writers, journaling finished steps and shards (writer thread only)."""

    def __init__(
        self, plan: Plan, staging: Path, journal: Journal | None, on_shard: Callable[[str, BinaryIO], None],
        on_follow: Callable[[str, FollowHash], None] | None = None,
    ) -> None:
        self.plan, self.staging, self.journal, self.on_shard = plan, staging, journal, on_shard
        self.on_follow = on_follow  # a new shard whose hash can follow its writes (`follow_hash`)
        self.open: dict[str, ShardWriter] = {}
        self.sizes: dict[str, int] = {}
        self.steps_of: dict[str, list[Step]] = {}
        for step in plan.steps:
            self.steps_of.setdefault(step.shard, []).append(step)
        done = journal.done if journal else None
        # A shard's finished steps count only while its file (final or partial) is still there.
        self.finished = {s for s in (done.shards if done else ()) if (staging / s).exists()}
        self.done_steps = {
            step.source.name
            for step in plan.steps
            if done
            and step.source.name in done.steps
            and (step.shard in self.finished or (staging / f"{step.shard}.partial").exists())
        }

    def is_done(self, step: Step) -> bool:
        return step.shard in self.finished or step.source.name in self.done_steps

    def finish_resumed(self) -> None:
        """Finalize shards whose every step was done before an interruption (killed while finalizing)."""
        for shard, steps in self.steps_of.items():
            if shard in self.finished:
                self.sizes[shard] = self._data_bytes(shard)
                self.on_shard(shard, open(self.staging / shard, "rb", buffering=0))  # noqa: SIM115 - callee closes
            elif all(s.source.name in self.done_steps for s in steps):
                self._finalize(self._writer(shard))

    def write(self, step: Step, entries: dict[str, torch.Tensor], found: tuple[int, int] | None = None) -> None:
        """Write a step's entries; `found`: its NaN and Inf counts (a kept tensor's), journaled with it."""
        writer = self._writer(step.shard)
        for key, data in entries.items():
            if isinstance(data, FileSlice):
                writer.copy_range(key, data.fd, data.offset, data.nbytes)
            else:
                writer.write(key, data)
            failpoints.hit("tensor-written")
        if self.journal is not None:
            blobs = {o.key: writer.blob(o.key) for o in step.outputs if o.shape is None}
            self.journal.step_done(step.source.name, blobs, found)
            failpoints.hit("step-journaled")
        if writer.done:
            self._finalize(writer)

    def _writer(self, shard: str) -> ShardWriter:
        if shard not in self.open:
            steps = self.steps_of[shard]
            resumed = [s for s in steps if s.source.name in self.done_steps]
            writer = ShardWriter(self.staging / shard, [o for s in steps for o in s.outputs], resume=bool(resumed))
            blobs = self.journal.done.steps if self.journal else {}
            for step in resumed:
                for o in step.outputs:
                    writer.restore(o.key, blobs[step.source.name].get(o.key))
            if self.on_follow is not None and (follow := writer.follow()) is not None:
                self.on_follow(shard, follow)
            self.open[shard] = writer
        return self.open[shard]

    def _finalize(self, writer: ShardWriter) -> None:
        shard = writer.path.name
        writer.finalize(on_sealed=lambda file: self.on_shard(shard, file))
        self.sizes[shard] = writer.data_bytes
        del self.open[shard]
        if self.journal is not None:
            self.journal.shard_done(shard)
            failpoints.hit("shard-journaled")

    def _data_bytes(self, shard: str) -> int:
        with open(self.staging / shard, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
        return (self.staging / shard).stat().st_size - 8 - header_len

    def abort(self) -> None:
        for w in self.open.values():
            w.abort()
