"""What a conversion records while it runs, and writes at its end: prequant.json (`checkpoint.manifest`'s format)
and the model card.

Shards are hashed on background threads the moment the writer finishes them (their pages are still in the page
cache, and hashing overlaps the rest of the conversion); the small files are hashed at the end. The manifest is
written into the staging folder and published with the rest, before config.json.
"""

from __future__ import annotations

import os
import queue
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any, BinaryIO

from ..bnb.format import entry_name
from ..bnb.stats import Collector, summarize
from ..checkpoint.hf_files import CARD, CONFIG, INDEX_NAMES
from ..checkpoint.manifest import FORMAT, FORMAT_VERSION, MANIFEST, sha256_file, versions
from ..checkpoint.reader import TensorReader
from ..checkpoint.safetensors import read_header
from ..checkpoint.tensors import TensorRef
from ..source.spec import Source
from ..util import trace
from ..util.fsio import write_json
from .card import write_card
from .kept import KeptCheck
from .follow_hash import FollowHash
from .plan import Plan

HASH_THREADS = max(1, min(4, (os.cpu_count() or 1) // 2))


class Recorder:
    """Collects what the manifest needs while convert runs (the pipeline's `on_shard` hook and its
    `stats`), then writes the model card and prequant.json into the staging folder."""

    def __init__(self, source: Source, plan: Plan, *, stats: bool = True, options: dict | None = None,
                 job: str | None = None, allow_nan: bool = False) -> None:
        self.source, self.plan, self.job = source, plan, job
        self.options = {**vars(plan.settings), **(options or {}), "llm_int8_skip_modules": plan.skip_modules,
                        "quantize_experts": plan.quantize_experts,
                        "stats": stats, "allow_nan": allow_nan}
        self.stats = Collector() if stats else None
        self.kept = KeptCheck(allow_nan)  # the pipeline's `check` of kept tensors; what it finds goes in the manifest
        self._hashes: dict[str, Future[str]] = {}
        self._queue: queue.Queue[tuple[BinaryIO | FollowHash, Future[str]] | None] = queue.Queue()
        # Shards are hashed side by side: one hashing thread is slower than a fast disk writes shards. Daemon
        # threads: a failed conversion never waits for them.
        self._threads = [threading.Thread(target=self._hash_loop, name=f"prequant-hash-{i}", daemon=True)
                         for i in range(HASH_THREADS)]
        for t in self._threads:
            t.start()

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        """End the hashing threads once what is queued is hashed: waited for after a success (instant, since
        `finish` has read every hash), not after a failure (nobody will read them)."""
        for _ in self._threads:
            self._queue.put(None)
        if exc_type is None:
            for t in self._threads:
                t.join()


    def on_shard(self, name: str, file: BinaryIO) -> None:
        """Pipeline hook: shard `name` is complete (`file` reads it); hash it now, in the background (unless its
        hash is following its writes already)."""
        if name in self._hashes:
            file.close()
            return
        future: Future[str] = Future()
        self._hashes[name] = future
        self._queue.put((file, future))

    def on_follow(self, name: str, follow: FollowHash) -> None:
        """Pipeline hook: shard `name` has just opened and its header is known: hash it as it is written."""
        future: Future[str] = Future()
        self._hashes[name] = future
        self._queue.put((follow, future))

    def _hash_loop(self) -> None:
        while (item := self._queue.get()) is not None:
            source, future = item
            try:
                with trace.busy("sha256"):
                    digest = source.run() if isinstance(source, FollowHash) else sha256_file(source, mapped=True)
                future.set_result(digest)
            except BaseException as e:  # noqa: BLE001 - handed to whoever reads the result
                future.set_exception(e)

    def finish(self, staging: Path, side_files: list[Path], *, device: str, repo_id: str | None = None,
               base: str | None = None) -> dict:
        """Write README.md (the model card) and prequant.json into `staging`; return the manifest. `base`: the
        base model's Hub repo id, when the user named it (--base-model); the manifest's source records the one the
        card names (`card.write_card`), null for none."""
        source = source_identity(self.source)
        if self.stats is not None:
            self._backfill_stats(staging)
        summary = summarize(self.stats.tensors) if self.stats is not None else None
        source["base_model"] = write_card(staging, source_dir=self.source.path, source=source, base_model=base,
                                          plan=self.plan, stats_summary=summary, repo_id=repo_id)
        names = [*self.plan.shards, *(p.as_posix() for p in side_files), CONFIG, CARD]
        names += [n for n in INDEX_NAMES if (staging / n).is_file()]
        return self._write(staging, names, source, device)

    def _backfill_stats(self, staging: Path) -> None:
        """Statistics of tensors a resumed run did not quantize itself, from the staged shards: the same
        numbers an uninterrupted run records (so both write the same manifest)."""
        missing = [s for s in self.plan.steps if s.quantize and s.source.name not in self.stats.tensors
                   and s.source.file.exists()]  # a Hub shard deleted after converting: its figures stay missing
        headers: dict[str, dict[str, TensorRef]] = {}
        with TensorReader() as src_data, TensorReader() as out_data:
            for step in missing:
                if step.shard not in headers:
                    headers[step.shard] = {t.name: t for t in read_header(staging / step.shard)[0]}
                refs, name = headers[step.shard], step.source.name
                entries = {entry_name(name, o.key): out_data.view(refs[o.key]) for o in step.outputs}
                x = src_data.view(step.source)
                self.stats.inspect(step, x.t() if step.decision.transpose else x, entries)

    def _write(self, staging: Path, files: list[str], source: dict, device: str) -> dict:
        entries = {}
        for name in sorted(set(files)):
            path = staging / name
            pending = self._hashes.get(name)
            digest = pending.result() if pending is not None else sha256_file(path)
            entries[name] = {"size": path.stat().st_size, "sha256": digest}
        tensors = self.stats.tensors if self.stats is not None else {}
        quantized = [s.source.name for s in self.plan.steps if s.quantize]
        manifest = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "versions": versions(),
            "device": device,
            "job": self.job,  # the conversion's fingerprint (source files, plan, version): a rerun knows it is done
            "source": source,
            "options": self.options,
            # Source names of the tensors quantized as their transpose (the planner's Decision.transpose).
            "transposed": [s.source.name for s in self.plan.steps if s.quantize and s.decision.transpose],
            "files": entries,
            "stats": {
                "enabled": self.stats is not None,
                # A resumed conversion has no statistics for the tensors done before the interruption.
                "complete": self.stats is not None and all(name in tensors for name in quantized),
                "summary": summarize(tensors) if self.stats is not None else None,
            },
            "tensors": {name: tensors[name].to_dict() for name in quantized if name in tensors},
            # Kept tensors holding NaN (copied with --allow-nan) or Inf (attention masks use it): their counts.
            "non_finite": self.kept.record(),
        }
        write_json(staging / MANIFEST, manifest, sort_keys=False)
        return manifest


def source_identity(src: Source) -> dict:
    """Where the weights came from: the Hub repo and commit when known, else the local path as given.

    Cheap hashes only: the source's config.json and index (a second read of hundreds of GB of weights
    is not cheap; a Hub commit sha pins them instead). Weight files are listed with their sizes.
    """
    ident: dict[str, Any] = {"spec": src.spec, "path": str(src.path), "format": src.format}
    if src.repo_id:
        ident.update(repo_id=src.repo_id, revision=src.revision, commit=src.sha)
    ident["weight_files"] = dict(src.weight_sizes)  # a Hub source's shards may be deleted by now
    for name in ("config.json", src.index_file.name if src.index_file is not None else None):
        if name and (src.path / name).is_file():
            ident.setdefault("sha256", {})[name] = sha256_file(src.path / name)
    return ident
