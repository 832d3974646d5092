"""OUTPUT_DIR/prequant.json: what a conversion wrote and how, so anyone can check it later.

It lists every output file with its size and sha256, where the weights came from, the versions and
options used, which tensors were quantized transposed (GPT-2 Conv1D: `verify --source` needs to know, and
a square weight's shape cannot tell), and per-tensor error statistics. Shards are hashed on a background
thread the moment the writer finishes them (their pages are still in the page cache, and hashing overlaps
the rest of the conversion); the small files are hashed at the end. The manifest is written into the
staging folder and published with the rest, before config.json.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import platform
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from importlib import metadata as importlib_metadata
from pathlib import Path
from typing import Any, BinaryIO

from . import reader, trace
from . import stats as stats_mod
from .errors import PrequantError
from .metadata import CARD, INDEX_NAMES, MANIFEST
from .plan import Plan
from .source import Source
from .writer import write_json

FORMAT = "prequant-manifest"
FORMAT_VERSION = 2  # 2 adds "transposed"; readers accept manifests without it (version 1)
READ_CHUNK = 8 * 1024 * 1024  # hashlib releases the GIL on large updates: hashing runs beside the pipeline
HASH_THREADS = max(1, min(4, (os.cpu_count() or 1) // 2))
_PACKAGES = ("torch", "bitsandbytes", "transformers", "safetensors", "huggingface_hub")


def sha256_file(path: Path | BinaryIO, on_bytes: Any = None, *, mapped: bool = False) -> str:
    """Hex sha256 of a file (a path, or a file open for reading, which is closed), read in large chunks;
    `on_bytes(n)` is called as bytes go by (progress).

    `mapped`: hash the page cache in place through a memory map rather than copying it out (GPU machine, a
    16 GB conversion's 5.7 GB: 1.19 against 0.91 GB/s), which shortens the tail of a conversion, where the
    last shard is hashed. Only for files this process has just written: if another process truncated the file
    meanwhile, reading the map would kill this one (SIGBUS), so files from elsewhere are read."""
    digest = hashlib.sha256()
    with (open(path, "rb", buffering=0) if isinstance(path, (str, Path)) else path) as f:
        if mapped and (size := os.fstat(f.fileno()).st_size):
            with mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ) as m:
                m.madvise(mmap.MADV_SEQUENTIAL)
                with memoryview(m) as view:
                    for start in range(0, size, READ_CHUNK):
                        n = min(READ_CHUNK, size - start)
                        digest.update(view[start:start + n])
                        # Unmap what was hashed (the page cache keeps it): else the whole shard counts in
                        # this process' RSS (measured: VmRSS 5.6 GiB for a 4.65 GB shard, 1.55 GiB before).
                        m.madvise(mmap.MADV_DONTNEED, start, n)
                        if on_bytes is not None:
                            on_bytes(n)
            return digest.hexdigest()
        buf = bytearray(READ_CHUNK)
        view = memoryview(buf)
        while n := f.readinto(buf):
            digest.update(view[:n])
            if on_bytes is not None:
                on_bytes(n)
    return digest.hexdigest()


class Recorder:
    """Collects what the manifest needs while convert runs (the pipeline's `on_shard` and `inspect`
    hooks), then writes the model card and prequant.json into the staging folder."""

    def __init__(self, source: Source, plan: Plan, *, stats: bool = True, options: dict | None = None) -> None:
        self.source, self.plan = source, plan
        self.options = {**vars(plan.settings), **(options or {}), "llm_int8_skip_modules": plan.skip_modules,
                        "stats": stats}
        self.stats = stats_mod.Collector() if stats else None
        self._hashes: dict[str, Future[str]] = {}
        self._queue: queue.Queue[tuple[BinaryIO, Future[str]] | None] = queue.Queue()
        # Shards are hashed side by side: one thread hashes ~1 GB/s, which a fast disk outruns (5 GB shards
        # finishing every 2 s from a 7 GB/s source). Daemon threads: a failed conversion never waits for them.
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

    @property
    def inspect(self) -> Callable[..., None] | None:
        """The pipeline's inspect hook (None when statistics are off, so the pipeline skips the call)."""
        return self.stats.inspect if self.stats is not None else None

    def on_shard(self, name: str, file: BinaryIO) -> None:
        """Pipeline hook: shard `name` is complete (`file` reads it); hash it now, in the background."""
        future: Future[str] = Future()
        self._hashes[name] = future
        self._queue.put((file, future))

    def _hash_loop(self) -> None:
        while (item := self._queue.get()) is not None:
            file, future = item
            try:
                with trace.busy("sha256"):
                    future.set_result(sha256_file(file, mapped=True))
            except BaseException as e:  # noqa: BLE001 - handed to whoever reads the result
                future.set_exception(e)

    def finish(self, staging: Path, side_files: list[Path], *, device: str, repo_id: str | None = None) -> dict:
        """Write README.md (the model card) and prequant.json into `staging`; return the manifest."""
        from . import card

        source = source_identity(self.source)
        if self.stats is not None:
            self._backfill_stats(staging)
        summary = stats_mod.summarize(self.stats.tensors) if self.stats is not None else None
        card.write_card(
            staging,
            source_dir=self.source.path,
            base_model=base_model(source),
            base_model_is_repo="repo_id" in source,
            plan=self.plan,
            stats_summary=summary,
            repo_id=repo_id,
        )
        names = [*self.plan.shards, *(p.as_posix() for p in side_files), "config.json", CARD]
        names += [n for n in INDEX_NAMES if (staging / n).is_file()]
        return self._write(staging, names, source, device)

    def _backfill_stats(self, staging: Path) -> None:
        """Statistics of tensors a resumed run did not quantize itself, from the staged shards: the same
        numbers an uninterrupted run records (so both write the same manifest)."""
        missing = [s for s in self.plan.steps if s.quantize and s.source.name not in self.stats.tensors
                   and s.source.file.exists()]  # a Hub shard deleted after converting: its figures stay missing
        headers: dict[str, dict[str, reader.TensorRef]] = {}
        with reader.TensorSource() as src_data, reader.TensorSource() as out_data:
            for step in missing:
                if step.shard not in headers:
                    headers[step.shard] = {t.name: t for t in reader.read_header(staging / step.shard)[0]}
                refs, name = headers[step.shard], step.source.name
                entries = {"weight" if key == name else key.removeprefix(name + "."): out_data.view(refs[key])
                           for key in (o.key for o in step.outputs)}
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
            "source": source,
            "options": self.options,
            # Source names of the tensors quantized as their transpose (the planner's Decision.transpose).
            "transposed": [s.source.name for s in self.plan.steps if s.quantize and s.decision.transpose],
            "files": entries,
            "stats": {
                "enabled": self.stats is not None,
                # A resumed conversion has no statistics for the tensors done before the interruption.
                "complete": self.stats is not None and all(name in tensors for name in quantized),
                "summary": stats_mod.summarize(tensors) if self.stats is not None else None,
            },
            "tensors": {name: tensors[name].to_dict() for name in quantized if name in tensors},
        }
        write_json(staging / MANIFEST, manifest, sort_keys=False)
        return manifest


def versions() -> dict[str, str | None]:
    """prequant's version and those of the libraries that decide the bytes (None when not installed)."""
    from . import __version__

    found: dict[str, str | None] = {"prequant": __version__, "python": platform.python_version()}
    for name in _PACKAGES:
        try:
            found[name] = importlib_metadata.version(name)
        except importlib_metadata.PackageNotFoundError:
            found[name] = None
    return found


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


def base_model(source: dict) -> str:
    """The base model's name for the card: the Hub repo id when known, else the source directory's name."""
    return source.get("repo_id") or Path(source["path"]).resolve().name


def load(output_dir: Path) -> dict:
    """Read and sanity-check OUTPUT_DIR/prequant.json; PrequantError (one line) if absent or malformed."""
    path = output_dir / MANIFEST
    if not path.is_file():
        raise PrequantError(
            f"{MANIFEST}: missing from {output_dir}; only a complete prequant conversion has one, convert again"
        )
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise PrequantError(f"{MANIFEST}: not valid JSON ({e}); the file is corrupt, convert again") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise PrequantError(f"{MANIFEST}: not a prequant manifest (no \"format\": \"{FORMAT}\"); convert again")
    files = manifest.get("files")
    if not isinstance(files, dict) or not all(
        isinstance(v, dict) and isinstance(v.get("size"), int) and isinstance(v.get("sha256"), str) for v in files.values()
    ):
        raise PrequantError(f"{MANIFEST}: its \"files\" table is malformed; the file is corrupt, convert again")
    transposed = manifest.get("transposed")  # absent from version 1 manifests
    if transposed is not None and not (isinstance(transposed, list) and all(isinstance(n, str) for n in transposed)):
        raise PrequantError(f"{MANIFEST}: its \"transposed\" list is malformed; the file is corrupt, convert again")
    return manifest
