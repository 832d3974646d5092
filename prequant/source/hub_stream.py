"""A Hub source's shards streamed during a conversion (`spec.hub` resolved the repo, `remote_headers` planned it).

`HubShardReader` downloads the shards in the order the plan reads them, `DOWNLOADS` at a time on threads of this
process, while the conversion goes on. The downloads start when the conversion calls `start` (as soon as the
tensors are known) or at the first read. Reading a shard waits until it is complete and its header has been checked
against the plan. Shards that were in the cache before the run are never deleted; those an interrupted run of the
same conversion downloaded are this run's to delete (`claim`).

With `delete`, each shard this run downloaded is deleted from the cache (`hub.cache.evict`) right after its last
tensor is written, and this run's shards take at most `SLOTS` times the largest shard's bytes of disk at any moment,
counted by `_Scratch`: a download counts with its whole size from the moment it starts (it starts only once that
fits), a downloaded shard with its size, a deleted one with its size until no descriptor or mapping of this process
holds it (its space is freed only then). So the next shard downloads while the one before is converted, and the one
after waits for a deletion. A killed run leaves only whole shards in the cache: huggingface_hub's partial downloads
are kept for the next run to resume or removed by it (`hub.cache.remove_stale_partials`).
"""

from __future__ import annotations

import gc
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from ..checkpoint.reader import TensorReader, scan_files
from ..checkpoint.tensors import TensorRef
from ..errors import PrequantError
from ..hub import cache, client
from ..util import trace
from .spec import Source

log = logging.getLogger(__name__)

# Two downloads at once keep the link busy while one of them waits for its first bytes or for room; more only split
# the same link.
DOWNLOADS = 2
SLOTS = 2  # with delete, this run's shards take at most SLOTS x the largest shard's bytes of disk
_LEAK_WAIT_S = 60.0  # a deleted shard still mapped after this long is a leak: stop waiting for it


class _Stopped(Exception):
    """The pipeline failed elsewhere, or the reader closed, while this thread waited for a download."""


class _Scratch:
    """This run's shards on disk against `budget` (module docstring). Not locked by itself: every method is called
    under the reader's condition, the one `wait_for_room` waits on and the reader notifies as shards come and go."""

    def __init__(self, sizes: dict[Path, int], cond: threading.Condition) -> None:
        """`sizes`: every shard's bytes."""
        self.sizes, self.cond = sizes, cond
        self.budget = SLOTS * max(sizes.values(), default=0)
        self.downloading: set[Path] = set()  # downloads in flight with delete: each counts with its whole size
        self.owned: dict[Path, Path] = {}  # downloaded by this run, still in the cache: path -> blob
        self.deleted: dict[Path, Path] = {}  # evicted by this run; on disk until gone and unmapped

    def held(self, *, deleted: bool = True) -> int:
        """Bytes of disk this run's shards take: the downloads in flight, the downloaded shards, and each deleted
        one still there (its space is freed only once the last descriptor or mapping goes). Without the deleted
        ones where `deleted` is false."""
        if self.deleted:
            held = _held_files()
            for path, blob in list(self.deleted.items()):
                if not os.path.lexists(blob) and f"{blob} (deleted)" not in held:
                    del self.deleted[path]
        shards = [*self.downloading, *self.owned, *self.deleted] if deleted else [*self.downloading, *self.owned]
        return sum(self.sizes[p] for p in shards)

    def wait_for_room(self, need: int, stopped: Callable[[], bool]) -> bool:
        """Wait until `need` more bytes fit in the budget; False once `stopped()`."""
        polls = 0  # of 0.1 s, while only deleted shards still mapped or open are in the way
        while not stopped() and self.held() + need > self.budget:
            self.cond.wait(0.1)
            if self.deleted and self.held(deleted=False) + need <= self.budget:
                polls += 1
                if polls % 20 == 0:
                    gc.collect()  # a reference cycle may hold the last view
                if polls > _LEAK_WAIT_S * 10:
                    log.warning("deleted shards still take disk space (%s); downloading on",
                                ", ".join(str(p) for p in sorted(self.deleted)))
                    self.deleted.clear()
        return not stopped()

    def leaving(self, path: Path) -> Path | None:
        """Shard `path` leaves the cache: if it is this run's, it counts as on disk until it is really gone. Its
        blob, or None where it is not this run's."""
        blob = self.owned.pop(path, None)
        if blob is not None:
            self.deleted[path] = blob
        return blob


class HubShardReader(TensorReader):
    """The TensorReader of a streamed Hub source (see the module docstring).

    Every read of a shard (`view`, `read_into`, `fd`) first waits for its download; the pipeline's reader
    calls `prepare(path, stop)` before the first read of each tensor so that the wait ends if the pipeline
    fails. `tensor_done(ref)` is called as each tensor's outputs are written.
    """

    def __init__(self, src: Source, tensors: Sequence[TensorRef], *, delete: bool = False) -> None:
        super().__init__()
        assert src.hub is not None
        self.src, self.hub, self.delete = src, src.hub, delete
        self._planned: dict[Path, dict[str, TensorRef]] = {}
        for ref in tensors:
            self._planned.setdefault(ref.file, {})[ref.name] = ref
        self._left = {path: len(refs) for path, refs in self._planned.items()}
        self._cond = threading.Condition()
        self.scratch = _Scratch({path: self.hub.files[self._name(path)] for path in self._planned}, self._cond)
        self._ready: dict[Path, BaseException | None] = {}  # downloaded and checked (None), or why not
        self._closed = False
        self._failed = False
        self._threads: list[threading.Thread] = []
        self._order = list(self._planned)  # the download order: the plan's
        self._next = 0  # the next shard of _order to be taken by a download thread
        self.downloaded: list[str] = []  # file names, in the order this run downloaded them
        self._begun: list[str] = []  # file names whose download this run began (journaled first)
        self._record: Callable[[str], None] | None = None  # `on_download`'s
        self._claimed: set[str] = set()  # downloaded by the interrupted run this one resumes (`claim`)
        self.evicted: list[str] = []

    # -- the pipeline's side

    def start(self) -> None:
        """Start downloading now, in plan order. Not for a resumed run before its journal has marked the finished
        tensors (`tensor_done`): it would download shards that are done; the first read starts it then."""
        with self._cond:
            if self._threads or self._closed:
                return
            for k in range(DOWNLOADS):
                thread = threading.Thread(target=self._download_all, name=f"prequant-download-{k}", daemon=True)
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
        run's to delete once converted, as if it had downloaded them itself; so is one whose blob that run finished
        but had not linked yet, once this run links it; the link of one whose eviction the interruption cut short
        (its blob gone) is removed. Call before the first read."""
        wanted = set(names)
        with self._cond:
            self._claimed = wanted
            for path in self._planned:
                if self._name(path) not in wanted or path in self.scratch.owned:
                    continue
                if path.is_file():
                    self.scratch.owned[path] = path.resolve()
                elif path.is_symlink():
                    cache.evict(self.hub.repo_id, self.hub.sha, self._name(path))

    def on_download(self, record: Callable[[str], None]) -> None:
        """Call `record(name)` for each shard this run begins to download into the cache, before its first byte
        (those begun so far at once)."""
        with self._cond:
            self._record = record
            done = list(self._begun)
        for name in done:
            record(name)

    def tensor_done(self, ref: TensorRef) -> None:
        """A tensor's outputs are written (or were, before a resume); with delete, its shard is deleted from the
        cache right after its last tensor, if this run downloaded it (or claimed it)."""
        path = ref.file
        with self._cond:
            if path not in self._left:
                return
            self._left[path] -= 1
            if not self.delete or self._left[path] > 0:
                return
            blob = self.scratch.leaving(path)
        self.release(path)
        if blob is not None:
            cache.evict(self.hub.repo_id, self.hub.sha, self._name(path))
            with self._cond:
                self.evicted.append(self._name(path))
        with self._cond:
            self._cond.notify_all()

    def close(self) -> None:
        """Stop: the downloads in flight end at their next read (their partial files stay, for the next run to
        resume)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        super().close()

    # -- internals

    def _name(self, path: Path) -> str:
        return path.relative_to(self.src.path).as_posix()

    def _download_all(self) -> None:
        """A download thread: take the next shard in plan order while there is room, until none is left."""
        while (path := self._take()) is not None:
            self._fetch(path)

    def _take(self) -> Path | None:
        """The next shard to download, once there is room for all of it (with delete); None when none is left or
        the reader stopped."""
        with self._cond:
            while self._next < len(self._order) and not (self._closed or self._failed):
                path = self._order[self._next]
                if self._left[path] == 0:  # every tensor done before a resume: not needed
                    self._next += 1
                    continue
                # A shard on disk already (downloaded by the interrupted run this one resumes: `claim`) takes no
                # more room; waiting for room for it would wait for itself.
                new = path not in self.scratch.owned
                need = self.scratch.sizes[path]
                if self.delete and new and not self.scratch.wait_for_room(need, lambda: self._closed):
                    return None
                if self._next >= len(self._order) or self._order[self._next] is not path:  # taken meanwhile
                    continue
                self._next += 1
                if self.delete and new:
                    self.scratch.downloading.add(path)
                return path
            return None

    def _proceed(self, path: Path) -> None:
        """Asked before each read of shard `path`'s download (`hub.transfer`'s `proceed`): raises once the reader
        is closed, which ends the download (its room on disk was made before it started)."""
        if self._closed:
            raise _Stopped(f"the download of {path.name} stopped: the conversion ended")

    def _fetch(self, path: Path) -> None:
        """Download `path` and say so to its reader; a failure is every later shard's too."""
        try:
            blob = self._download(path)
        except BaseException as e:  # noqa: BLE001 - raised by each read of this and later shards
            if isinstance(e, PrequantError) and not self._closed:
                e = e.noted("; the tensors converted so far are kept: run the same command again to continue "
                            "from them")
            with self._cond:
                self.scratch.downloading.discard(path)
                self._failed = True
                for later in self._order[self._order.index(path):]:
                    self._ready.setdefault(later, e)  # not those downloaded already
                self._cond.notify_all()
            return
        with self._cond:
            self.scratch.downloading.discard(path)
            if blob is not None:
                self.scratch.owned[path] = blob
            self._ready[path] = None
            self._cond.notify_all()  # a shard already in the cache gives its room back

    def _download(self, path: Path) -> Path | None:
        """Download one shard and check its header against the plan; its blob if this run put
        it in the cache (it was not complete there, and its blob did not exist, when the download began)."""
        name = self._name(path)
        blobs = cache.blobs_folder(self.hub.repo_id)
        cached = path.is_file() and path.stat().st_size == self.hub.files[name]
        before = set(os.listdir(blobs)) if blobs.is_dir() else set()
        if not cached:  # journaled before any byte lands in the cache: a kill after the download, before it is
            with self._cond:  # recorded, would otherwise leave this job's shard looking like the user's
                self._begun.append(name)
                record = self._record
            if record is not None:
                record(name)
        started = time.monotonic()
        trace.mark(f"download-start:{name}")
        fetched = client.download(self.hub, name, large=True, proceed=lambda: self._proceed(path))
        trace.mark(f"download-done:{name}")
        log.debug("downloaded %s in %.1fs", name, time.monotonic() - started)
        blob = fetched.resolve()
        # Put in the cache by this run, or by the interrupted run it resumes (a blob that run finished and had not
        # yet linked when it was killed): its to delete.
        owned = not cached and (blob.name not in before or name in self._claimed)
        if owned:
            with self._cond:
                self.downloaded.append(name)
        try:
            if {t.name: t for t in scan_files([path])} != self._planned[path]:
                raise PrequantError(
                    f"{name} of {self.hub.repo_id}@{self.hub.sha[:12]}: the downloaded file's tensors differ "
                    "from the header read before the download; the cached file is corrupt, run again"
                )
        except PrequantError:
            if owned:
                cache.evict(self.hub.repo_id, self.hub.sha, name)  # never leave a bad file for the next run to trust
            raise
        return blob if owned else None


def _held_files() -> set[str]:
    """The deleted files this process still maps or holds open, each as "PATH (deleted)" (how /proc names them)."""
    held: set[str] = set()
    try:
        for line in Path("/proc/self/maps").read_text().splitlines():
            fields = line.split(maxsplit=5)  # address, perms, offset, device, inode, path
            if len(fields) == 6 and fields[5].endswith(" (deleted)"):
                held.add(fields[5])
        for fd in os.listdir("/proc/self/fd"):
            try:
                held.add(os.readlink(f"/proc/self/fd/{fd}"))
            except OSError:
                continue
    except OSError:
        pass
    return held


__all__ = ["DOWNLOADS", "SLOTS", "HubShardReader"]
