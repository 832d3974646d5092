"""What a conversion writes besides its shards, and what it records for them while it runs: config.json with its
quantization_config, the index, the source's side files, the NaN and Inf found in the tensors kept unquantized, the
shards' sha256, and at the end the model card and prequant.json (`checkpoint.manifest`'s format), all into the
staging folder, published with the rest before config.json.

Shards are hashed on background threads as soon as the writer finishes them, while their pages are in the page cache
and the rest of the conversion goes on; the small files are hashed at the end.

A NaN in a kept tensor poisons every forward through it: it is refused unless --allow-nan. An Inf is not always
damage (attention masks and some biases use it on purpose): it is recorded and reported, not refused. The check is
one reduction (`aminmax`, which propagates NaN) over the bytes the conversion reads anyway; only a tensor that fails
it is counted precisely, in bounded chunks.
"""

from __future__ import annotations

import logging
import os
import queue
import shutil
import stat
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any, BinaryIO

import torch

from ..bnb.format import entry_name, quantization_config
from ..bnb.stats import Collector, summarize
from ..checkpoint.hf_files import (
    ADAPTER_CONFIG,
    ADAPTER_FILES,
    CARD,
    CONFIG,
    INDEX_NAMES,
    SAFETENSORS_INDEX,
    WEIGHT_SUFFIXES,
    cache_repo_dir,
)
from ..checkpoint.manifest import FORMAT, FORMAT_VERSION, MANIFEST, sha256_file, versions
from ..checkpoint.reader import TensorReader
from ..checkpoint.safetensors import read_header
from ..checkpoint.tensors import TensorRef
from ..errors import PrequantError, flag
from ..source.spec import Source
from ..util import trace
from ..util.fsio import write_error, write_json
from .card import write_card
from .follow_hash import FollowHash
from .plan import Plan

log = logging.getLogger("prequant")
HASH_THREADS = max(1, min(4, (os.cpu_count() or 1) // 2))
CHECKED = (torch.float16, torch.bfloat16, torch.float32, torch.float64)  # float8 has no Inf (e4m3) or no use for it
_COUNT_CHUNK = 1 << 24


def write_config(staging: Path, config: dict, plan: Plan) -> None:
    """config.json: the source's, plus quantization_config."""
    qc = quantization_config(plan.settings, plan.skip_modules)
    write_json(staging / CONFIG, {**config, "quantization_config": qc})


def write_index(staging: Path, plan: Plan, shard_sizes: dict[str, int]) -> None:
    """model.safetensors.index.json listing every key, when there is more than one shard."""
    if len(plan.shards) == 1:
        return
    weight_map = {o.key: s.shard for s in plan.steps for o in s.outputs}
    index = {"metadata": {"total_size": sum(shard_sizes.values())}, "weight_map": dict(sorted(weight_map.items()))}
    write_json(staging / SAFETENSORS_INDEX, index, sort_keys=False)


def side_files(source_dir: Path) -> list[Path]:
    """Files of the source to carry over (tokenizer, generation config, templates, code, licence), relative.
    Not its weights, index, config, manifest or card: the output has its own (the card carries the original). Not a
    peft adapter's files either (a folder holding adapter_config.json is an adapter's, and that file beside the
    model makes transformers take it for one). A symlink is followed only where it resolves inside SOURCE, or, for a
    snapshot of the Hugging Face cache, inside that repo's blobs folder (the snapshot's own links): one that leads
    elsewhere (a secret linked in, say) is left out, said on stderr."""
    roots = _allowed_roots(source_dir)
    paths = sorted(source_dir.rglob("*"))
    adapters = [p.parent.relative_to(source_dir) for p in paths if p.name == ADAPTER_CONFIG and p.parent != source_dir]
    found = []
    for path in paths:
        rel = path.relative_to(source_dir)
        if any(part.startswith(".") for part in rel.parts) or not path.is_file():
            continue  # .git, .cache (the Hub's download metadata), editor files
        if rel.suffix in WEIGHT_SUFFIXES or rel.name in INDEX_NAMES or rel.as_posix() in (CONFIG, MANIFEST, CARD):
            continue
        if rel.name in ADAPTER_FILES or any(rel.is_relative_to(folder) for folder in adapters):
            continue
        real = Path(os.path.realpath(path))
        if not any(real.is_relative_to(root) for root in roots):
            log.warning("%s is a link to %s, outside the source: not copied (copy the file itself into the source to "
                        "carry it over)", rel.as_posix(), real)
            continue
        found.append(rel)
    return found


def _allowed_roots(source_dir: Path) -> list[Path]:
    """Where a side file's real path may lie: SOURCE; and for a Hugging Face cache snapshot
    (models--org--name/snapshots/<commit>), that repo's blobs folder (models--org--name/blobs), where the snapshot's
    files link to."""
    roots = [Path(os.path.realpath(source_dir))]
    if (repo := cache_repo_dir(source_dir)) is not None:
        roots.append(Path(os.path.realpath(repo / "blobs")))
    return roots


def copy_side_files(source_dir: Path, staging: Path, files: list[Path]) -> None:
    """Copy `side_files(source_dir)` into the staging folder, keeping their relative paths; a copy's permissions
    are never wider than its original's (a file readable by its owner alone stays so)."""
    for rel in files:
        try:
            (staging / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source_dir / rel, staging / rel)
            mode = stat.S_IMODE(os.stat(source_dir / rel).st_mode)
            os.chmod(staging / rel, stat.S_IMODE(os.stat(staging / rel).st_mode) & mode)
        except OSError as e:
            # Opening the source's file failed (only then is filename2 unset: shutil's sendfile path names
            # both files on a failed write), or writing the copy did: say which, and what to do.
            if e.filename == str(source_dir / rel) and e.filename2 is None:
                raise PrequantError(
                    f"cannot read it ({e.strerror or e}); make it readable, or move it out of the source directory",
                    where=source_dir / rel,
                ) from e
            raise write_error(staging / rel, e) from e


# ------------------------------------------------------------------------------------ kept tensors


def non_finite(t: torch.Tensor) -> tuple[int, int]:
    """(NaN count, Inf count) of a tensor; (0, 0) for integer, bool and float8 tensors."""
    if t.dtype not in CHECKED or t.numel() == 0:
        return 0, 0
    lo, hi = torch.aminmax(t)
    if bool(torch.isfinite(lo)) and bool(torch.isfinite(hi)):
        return 0, 0
    flat, nan, inf = t.reshape(-1), 0, 0
    for start in range(0, flat.numel(), _COUNT_CHUNK):
        part = flat[start : start + _COUNT_CHUNK]
        nan += int(torch.isnan(part).sum())
        inf += int(torch.isinf(part).sum())
    return nan, inf


class KeptCheck:
    """Checks each kept tensor (called from the pipeline's threads) and keeps what it found, by source name."""

    def __init__(self, allow_nan: bool) -> None:
        self.allow_nan = allow_nan
        self.found: dict[str, tuple[int, int]] = {}  # name -> (NaN, Inf), only tensors with any
        self._lock = threading.Lock()

    def __call__(self, name: str, tensor: torch.Tensor) -> tuple[int, int] | None:
        """Refuse a NaN (PrequantError naming the tensor) unless allowed; return the counts when not all finite."""
        nan, inf = non_finite(tensor)
        if not (nan or inf):
            return None
        if nan and not self.allow_nan:
            also = f" (and {inf:,} Inf)" if inf else ""
            raise PrequantError(
                f"tensor {name!r}, kept unquantized, holds {nan:,} NaN values{also}, which poison every forward "
                f"through it; fix the source checkpoint, or pass {flag('allow_nan')} to copy it as it is (recorded in "
                "prequant.json)"
            )
        with self._lock:
            self.found[name] = (nan, inf)
        return nan, inf

    def record(self) -> dict[str, dict[str, int]]:
        """prequant.json's "non_finite" table."""
        return {name: {"nan": nan, "inf": inf} for name, (nan, inf) in sorted(self.found.items())}


# ---------------------------------------------------------------------------------------- prequant.json


def recorded_options(plan: Plan, options: dict | None, *, stats: bool, allow_nan: bool) -> dict:
    """The options prequant.json records: the plan's settings, the caller's `options`, and what the plan decided."""
    return {**vars(plan.settings), **(options or {}), "llm_int8_skip_modules": plan.skip_modules,
            "quantize_experts": plan.quantize_experts, "stats": stats, "allow_nan": allow_nan}


class Recorder:
    """Collects what the manifest needs while convert runs (the pipeline's `on_shard` and `on_follow` hooks, its
    `stats` and its `check` of kept tensors), then writes the model card and prequant.json into the staging folder."""

    def __init__(self, source: Source, plan: Plan, options: dict, *, job: str | None = None) -> None:
        """`options`: what prequant.json records as the job's options (`recorded_options`), its stats and allow_nan
        among them."""
        self.source, self.plan, self.job, self.options = source, plan, job, options
        self.stats = Collector() if options["stats"] else None
        self.kept = KeptCheck(options["allow_nan"])  # the pipeline's `check` of kept tensors, its findings recorded
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
        else:
            self._hash(name, file)

    def digest(self, name: str) -> str:
        """Sealed shard `name`'s sha256 (waits for its hash)."""
        return self._hashes[name].result()

    def on_follow(self, name: str, follow: FollowHash) -> None:
        """Pipeline hook: shard `name` has just opened and its header is known: hash it as it is written."""
        self._hash(name, follow)

    def _hash(self, name: str, source: BinaryIO | FollowHash) -> None:
        future: Future[str] = Future()
        self._hashes[name] = future
        self._queue.put((source, future))

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
        trace.mark("card-written")  # then the manifest, once the last shards' hashes are done
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

    def write_manifest(self, staging: Path, files: list[str], source: dict, device: str, **extra: Any) -> dict:
        """prequant.json alone, for a job that writes its own card (a merge); `extra`: its own top-level keys."""
        return self._write(staging, files, source, device, extra)

    def _write(self, staging: Path, files: list[str], source: dict, device: str, extra: dict | None = None) -> dict:
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
            **(extra or {}),
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
