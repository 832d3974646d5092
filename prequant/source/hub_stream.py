"""A Hub source's shards streamed during a conversion (`hub_repo` resolved the repo, `remote_headers` planned it).

`HubShardReader` downloads the shards in the order the plan reads them, `DOWNLOADS` at a time
while the conversion goes on, each thread through a child process of its own (`hub.fetcher`: not behind this
one's GIL). The downloads start when the conversion calls `start` (as soon as the tensors are known, so that the
first shards download while the layout is decided and the quantizer starts), or at the first read. Reading a
shard waits until it is complete and its header has been checked against the plan. Shards that were in the cache
before the run are never deleted; those an interrupted run of the same conversion downloaded are this run's to
delete (`claim`).

With `delete`, this run's shards take at most twice the largest shard's bytes of disk at any moment, counted in bytes
by `hub_scratch.Scratch`: a download holds what it may write so far (its limit, `hub.fetcher`; the whole shard with
PREQUANT_HUB_FREE_AS_CONVERTED=0), a downloaded shard its size less what was freed of it.
A shard is freed as it is converted (`FREE_ENV`): at its
first tensor written it leaves the cache (its snapshot link deleted, its blob renamed, open here and by name for the
CPU workers: `client.set_aside`), and each tensor written gives its whole blocks back to the disk (`util.holes`);
the last one deletes it. So the next shard downloads while the one before is converted, rather than after (the
two-shard bound held the third download until the first shard was converted: 15.5 s into a cold Grok-shaped 33 GB
conversion from the local Hub on the GPU machine, run U), and a killed run leaves nothing with holes that looks
complete: the shard it was freeing stays as ``<etag>.prequant-freeing``, which the next download from the repo
removes (`client.remove_stale_partials`). Where holes cannot be punched (the filesystem, `.bin` shards: no byte ranges) a
shard is freed whole after its last tensor, as before; where downloads cannot be limited, one starts only once all
of it fits.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from ..checkpoint.reader import TensorReader, scan_files
from ..checkpoint.tensors import BIN_OFFSET, TensorRef
from ..errors import PrequantError
from ..hub import client, fetcher
from ..util import holes, trace
from .hub_scratch import Scratch
from .spec import Source

log = logging.getLogger(__name__)

# Unset or "1": shards freed as they are converted and downloads held to their grants (module docstring). "0": each
# shard freed whole after its last tensor, and a download started only once all of it fits, as before 2026-12-05.
# A Grok-shaped 33 GB repo from the local Hub on an H100 machine, --delete-source-shards, endpoint cold: freeing
# 24.35-25.33 s (1.09-1.13x the floor, four runs; the third download began at 4.2-4.7 s, as the first shard arrived)
# against 25.59-27.94 s (1.15-1.24x, five runs; the third at 8.4-9.4 s, once the first shard was converted) freeing
# whole; this run's shards at most 9.66 GB, the two-shard bound, either way; same bytes (`scripts/bench/hub_scale.py
# --shape grok --size-gb 33 --device cuda --skip-download` with --repeats and --variant, two calls, 2026-12-05:
# run Y in docs/performance.md gives each call's command).
FREE_ENV = "PREQUANT_HUB_FREE_AS_CONVERTED"
# Shards downloading at once: two. Through prequant's own transfer (`hub.transfer`) a 33 GB Grok-shaped repo from
# the local Hub on the GPU machine downloaded its shards 3-7 (23.1 GB, after the first shard was converted) at 1.21
# and 1.62 GB/s with two against 1.05 and 1.40 GB/s with one, on two leases (scripts/bench/hub_scale.py,
# 2026-12-04; the whole runs differed by their cold start-ups more than by this). huggingface_hub's own loop
# (PREQUANT_HUB_CLIENT=huggingface_hub) gains more from two: one download took 0.53-0.75 GB/s where curl read
# 1.1-1.4. PREQUANT_HUB_DOWNLOADS overrides it; with --delete-source-shards the scratch bound holds whatever it is (a
# partial download counts as on disk: `hub_scratch`).
DOWNLOADS = 2
DOWNLOADS_ENV = "PREQUANT_HUB_DOWNLOADS"


class _Stopped(Exception):
    """The pipeline failed elsewhere while this thread waited for a download."""


class HubShardReader(TensorReader):
    """The TensorReader of a streamed Hub source (see the module docstring).

    Every read of a shard (`view`, `read_into`, `fd`) first waits for its download; the pipeline's reader
    calls `prepare(path, stop)` before the first read of each tensor so that the wait ends if the pipeline
    fails. `tensor_done(ref)` is called as each tensor's outputs are written.
    """

    def __init__(self, src: Source, tensors: Sequence[TensorRef], *, delete: bool = False) -> None:
        super().__init__()
        assert src.hub is not None
        self.src, self.delete = src, delete
        self._planned: dict[Path, dict[str, TensorRef]] = {}
        for ref in tensors:
            self._planned.setdefault(ref.file, {})[ref.name] = ref
        self._left = {path: len(refs) for path, refs in self._planned.items()}
        self._cond = threading.Condition()
        # This run's shards on disk, within their budget with delete (module docstring); changed under _cond.
        self.scratch = Scratch({path: src.hub.files[self._name(path)] for path in self._planned}, self._cond)
        self._to_free: dict[Path, list[tuple[int, int]]] = {}  # written tensors' byte ranges not yet freed
        self._stream = os.environ.get(FREE_ENV, "1").strip() != "0"  # shards freed as converted (FREE_ENV)
        self._holes = self._stream  # until the filesystem says it cannot
        self._aside: dict[Path, client.SetAside] = {}  # a shard being freed: out of the cache, its lock held
        self._whole: set[Path] = set()  # this run's shards that could not be set aside: freed whole at the end
        self._ready: dict[Path, BaseException | None] = {}  # downloaded and checked (None), or why not
        self._downloading = 0  # downloads in flight
        self._closed = False
        self._failed = False
        self._threads: list[threading.Thread] = []
        self._order = list(self._planned)  # the download order: the plan's
        self._next = 0  # the next shard of _order to be taken by a download thread
        # Downloads run in child processes, not behind this one's GIL, one per download thread (a child dies with
        # the thread that started it); the CLI may have begun the first (`hub_early`): the first thread's.
        self._fetchers: list[fetcher.Fetcher] = [fetcher.adopt(src.hub)]
        self.downloaded: list[str] = []  # file names, in the order this run downloaded them
        self._record: Callable[[str], None] | None = None  # `on_download`'s
        self.evicted: list[str] = []

    # -- the pipeline's side

    def start(self) -> None:
        """Start downloading now, in plan order. Not for a resumed run before its journal has marked the finished
        tensors (`tensor_done`): it would download shards that are done; the first read starts it then."""
        with self._cond:
            if self._threads or self._closed:
                return
            for k in range(_downloads()):
                thread = threading.Thread(target=self._download_all, args=(k,), name=f"prequant-download-{k}",
                                          daemon=True)
                self._threads.append(thread)
                thread.start()

    def prepare(self, path: Path, stop: threading.Event | None = None) -> None:
        """Wait until shard `path` is downloaded and checked; raise its download's error, if any."""
        if self._ready.get(path, False) is None or path not in self._planned:
            return
        self.start()
        with self._cond:
            while path not in self._ready:
                if self._closed or (stop is not None and stop.is_set()):
                    raise _Stopped(path.name)
                self._cond.wait(0.1)
            error = self._ready[path]
        if error is not None:
            raise error

    def fd(self, path: Path) -> int:
        self.prepare(path)
        return super().fd(path)

    def view(self, ref: TensorRef):  # type: ignore[override]
        self.prepare(ref.file)
        return super().view(ref)

    def read_into(self, ref: TensorRef, start: int, out: memoryview) -> None:
        self.prepare(ref.file)
        super().read_into(ref, start, out)

    def claim(self, names: Iterable[str]) -> None:
        """Shards that an interrupted run of this conversion downloaded (its journal says which): with delete, this
        run's to delete once converted, as if it had downloaded them itself. Call before the first read."""
        wanted = set(names)
        with self._cond:
            for path in self._planned:
                if self._name(path) in wanted and path not in self.scratch.owned and path.is_file():
                    self.scratch.own(path, path.resolve())

    def on_download(self, record: Callable[[str], None]) -> None:
        """Call `record(name)` for each shard this run downloads into the cache (those downloaded so far at once)."""
        with self._cond:
            self._record = record
            done = list(self.downloaded)
        for name in done:
            record(name)

    def tensor_done(self, ref: TensorRef) -> None:
        """A tensor's outputs are written (or were, before a resume); with delete, its shard is freed as it goes
        (module docstring) and evicted after its last tensor."""
        path = ref.file
        with self._cond:
            if path not in self._left:
                return
            self._left[path] -= 1
            if not self.delete:
                return
            ours = (path in self.scratch.owned or path in self._aside) and path not in self._whole
            last = self._left[path] == 0
            if not last:
                if ours and self._holes and ref.offset != BIN_OFFSET and ref.nbytes:
                    self._to_free.setdefault(path, []).append((ref.offset, ref.offset + ref.nbytes))
                blob = None
            else:
                self._to_free.pop(path, None)
                blob = self.scratch.leaving(path)
        if not last:
            if path in self._to_free:
                self._free_written(path)
            return
        self.release(path)
        self._drop_aside(path)
        if blob is not None:
            client.evict(self.src.hub, self._name(path))  # type: ignore[arg-type]
            with self._cond:
                self.evicted.append(self._name(path))
        with self._cond:
            self.scratch.regrant()

    def _free_written(self, path: Path) -> None:
        """Give the written tensors' blocks of shard `path` back to the disk; at the first, take the shard out of
        the cache (`client.set_aside`: it stays open here, and by its new name for the CPU workers), so that nothing
        with holes is ever there to look complete."""
        if self._closed or not self.holds(path):
            return  # not read yet (a resume's finished tensors): freed with the first tensor written after it opens
        with self._cond:
            first = path in self.scratch.owned
            ranges = self._to_free.pop(path, [])
        if first:
            aside = client.set_aside(self.src.hub, self._name(path))  # type: ignore[arg-type]
            with self._cond:
                if aside is None:  # freed whole after its last tensor, as without holes
                    self._whole.add(path)
                    return
                self.scratch.leaving(path, aside.path)  # on disk until deleted (`_drop_aside`) and closed
                self._aside[path] = aside
                self.evicted.append(self._name(path))
        aside = self._aside.get(path)
        freed = 0
        try:
            freed = aside.free(ranges) if aside is not None else 0
        except holes.Unsupported as e:
            log.info("cannot free converted parts of %s (%s): each shard is freed after its last tensor",
                     self._name(path), e)
            self._holes = False
        except OSError as e:  # advisory: the shard is freed whole after its last tensor anyway
            log.debug("freeing converted parts of %s failed: %s", self._name(path), e)
        with self._cond:
            self.scratch.free(path, freed)

    def _drop_aside(self, path: Path | None = None) -> None:
        """Delete the shard(s) set aside (`_free_written`), every one without a path: converted, or the run over."""
        with self._cond:
            asides = [self._aside.pop(path, None)] if path is not None else list(self._aside.values())
            if path is None:
                self._aside.clear()
        for aside in asides:
            if aside is not None:
                aside.drop()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            cut = self._downloading > 0  # a download in flight: its fetcher kills it, leaving its partial file
            fetchers = list(self._fetchers)
            self._cond.notify_all()
        for each in fetchers:
            each.close()
        if cut:
            client.remove_stale_partials(self.src.repo_id)  # type: ignore[arg-type]
        super().close()
        self._drop_aside()  # half-freed shards are of no use to anyone: a resume downloads them again

    # -- internals

    def _name(self, path: Path) -> str:
        return path.relative_to(self.src.path).as_posix()

    def _download_all(self, k: int) -> None:
        """Download thread `k`: take the next shard in plan order while there is room, until none is left."""
        with self._cond:
            if k == len(self._fetchers):
                self._fetchers.append(fetcher.Fetcher(self.src.hub))  # type: ignore[arg-type]
            mine = self._fetchers[k]
        try:
            while (path := self._take(mine, first=k == 0)) is not None:
                self._fetch(path, mine)
        finally:
            mine.close()  # nothing more to fetch (on Linux its child would die with this thread anyway)

    def _take(self, mine: fetcher.Fetcher, first: bool) -> Path | None:
        """The next shard to download, once there is room for it (its grant set, with delete); None when none is
        left or the reader stopped. The first thread takes the first shard: its fetcher may have begun it
        (`hub_early`)."""
        limited = self.delete and self._stream and mine.limits
        with self._cond:
            while not first and self._next == 0 and not self._closed:
                self._cond.wait(0.1)
            while self._next < len(self._order) and not (self._closed or self._failed):
                path = self._order[self._next]
                if self._left[path] == 0:  # every tensor done before a resume: not needed
                    self._next += 1
                    continue
                # A shard on disk already (downloaded by the interrupted run this one resumes: `claim`) takes no
                # more room; waiting for room for it would wait for itself.
                new = path not in self.scratch.owned
                if self.delete and new and not self.scratch.wait_for_room(self.scratch.first_grant(path, limited),
                                                                          lambda: self._closed):
                    return None
                if self._next >= len(self._order) or self._order[self._next] is not path:  # taken meanwhile
                    continue
                self._next += 1
                self._downloading += 1
                if self.delete and new:
                    self.scratch.grant(path, mine if limited else None)
                self._cond.notify_all()  # the other threads wait for the first shard to be taken
                return path
            return None

    def _fetch(self, path: Path, mine: fetcher.Fetcher) -> None:
        """Download `path` with `mine` and say so to its reader; a failure is every later shard's too."""
        try:
            blob = self._download(path, mine, limited=path in self.scratch.limited)
        except BaseException as e:  # noqa: BLE001 - raised by each read of this and later shards
            if isinstance(e, PrequantError) and not self._closed:
                e = e.noted("; the tensors converted so far are kept: rerun the same command with --resume to "
                            "continue from them")
            with self._cond:
                self._downloading -= 1
                self.scratch.downloaded(path, None)
                self._failed = True
                for later in self._order[self._order.index(path):]:
                    self._ready.setdefault(later, e)  # not those downloaded already
                self._cond.notify_all()
            return
        with self._cond:
            self._downloading -= 1
            self.scratch.downloaded(path, blob)
            self._ready[path] = None
            self.scratch.regrant()  # a shard already in the cache gives its grant back

    def _download(self, path: Path, mine: fetcher.Fetcher, *, limited: bool = False) -> Path | None:
        """Download one shard (held to its grant where `limited`) and check its header against the plan; its blob
        if this run put it in the cache."""
        assert self.src.hub is not None
        name = self._name(path)
        started = time.monotonic()
        trace.mark(f"download-start:{name}")
        fetched = mine.download(name, limited=limited)
        trace.mark(f"download-done:{name}")
        log.debug("downloaded %s in %.1fs", name, time.monotonic() - started)
        blob = fetched.path.resolve()
        owned = fetched.fresh  # put in the cache by this run (the CLI's early download included): its to delete
        if owned:
            with self._cond:
                self.downloaded.append(name)
                record = self._record
            if record is not None:
                record(name)
        try:
            if {t.name: t for t in scan_files([path])} != self._planned[path]:
                raise PrequantError(
                    f"{name} of {self.src.repo_id}@{self.src.hub.sha[:12]}: the downloaded file's tensors differ "
                    "from the header read before the download; the cached file is corrupt, run again"
                )
        except PrequantError:
            if owned:
                client.evict(self.src.hub, name)  # never leave a bad file for the next run to trust
            raise
        return blob if owned else None


def _downloads() -> int:
    """How many shards download at once: PREQUANT_HUB_DOWNLOADS, else DOWNLOADS (at least one)."""
    try:
        return max(1, int(os.environ.get(DOWNLOADS_ENV, DOWNLOADS)))
    except ValueError:
        return DOWNLOADS


__all__ = ["DOWNLOADS", "FREE_ENV", "HubShardReader"]
