"""A Hub source's first shards, begun by the CLI before torch's import.

A process spends seconds importing torch, CUDA and bitsandbytes before `convert()` resolves anything. A local
source's disk reads ahead meanwhile (`conversion.readahead.prefetch`); for a Hub source, `begin` starts the network
instead: on a thread, it resolves the repo (one API call), downloads its index and begins the first shards the
conversion reads (the index's first `hub_stream.DOWNLOADS`, within the two-shard bound on disk), each on a thread
through `hub.client.download`: the same retries, the same cache layout and partial files as the conversion's own
downloads.

The CLI hands the `HeadStart` to `convert()` (`ConvertOptions.head_start`), whose `HubShardReader` adopts each begun
download (`take`): it waits for it instead of downloading the shard again, and a shard the head start put in the
cache counts as this run's download (journaled, deleted with --delete-source-shards). `close` ends what no reader
adopted: a download in flight stops at its next read (its partial file stays, for the next run to resume), and with
`delete` a finished shard that was not in the cache before leaves it again.

Standard library at import (huggingface_hub once a Hub source is named). Purely a head start: any failure here is left for the
conversion to meet and report itself.
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ..checkpoint.hf_files import shard_names, weight_layout
from ..util import trace
from .spec import hub_spec

if TYPE_CHECKING:
    from ..hub.client import HubCommit

log = logging.getLogger(__name__)

SHARDS = 2  # begun at most: `hub_stream.DOWNLOADS` (two in flight), which the two-shard scratch bound allows too


class Stopped(Exception):
    """The head start was closed while its download ran."""


@dataclass
class Begun:
    """One shard's download begun by the head start: what the cache held when it began (`hub_stream` decides from
    that whether the shard is this run's), and its result, the shard's path in the cache."""

    name: str
    cached: bool  # the whole shard was in the cache already: nothing was downloaded
    blobs_before: set[str]  # the cache's blob names when it began
    result: Future = field(default_factory=Future)
    adopted: bool = False


class HeadStart:
    """The downloads `begin` started for one Hub repo (see the module docstring)."""

    def __init__(self, repo_spec: str, *, delete: bool) -> None:
        self.delete = delete
        self.listing: HubCommit | None = None  # once resolved
        self._begun: dict[str, Begun] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._begin, args=(repo_spec,), name="prequant-hub-early",
                                        daemon=True)
        self._thread.start()

    def take(self, listing: HubCommit, name: str) -> Begun | None:
        """Shard `name`'s download, if this head start began it for the same commit: the caller's from now on."""
        self._thread.join()
        with self._lock:
            begun = self._begun.get(name)
            if begun is None or self.listing is None or (self.listing.repo_id, self.listing.sha) != (
                    listing.repo_id, listing.sha) or self._closed:
                return None
            begun.adopted = True
            return begun

    def close(self) -> None:
        """Stop the downloads in flight at their next read; with `delete`, take a finished shard that no reader
        adopted and that was not in the cache before out of it again."""
        with self._lock:
            self._closed = True
            left = [b for b in self._begun.values() if not b.adopted]
        for begun in left:
            if begun.result.done():
                self._forget(begun)

    # -- the threads

    def _begin(self, repo_spec: str) -> None:
        from ..hub import cache, client

        try:
            repo_id, revision = client.parse_repo_spec(repo_spec)
            listing = client.resolve(repo_id, revision)
            layout = weight_layout(listing.files)  # what `spec.hub` will find
            if layout is None:
                return
            index, single, _ = layout
            names = shard_names(repo_id, client.download(listing, index)) if index else [single]
            blobs = cache.blobs_folder(repo_id)
            with self._lock:
                self.listing = listing
                for name in [n for n in dict.fromkeys(names) if n in listing.files][:SHARDS]:
                    if self._closed:
                        return
                    path = client.cache_path(listing, name)
                    cached = path.is_file() and path.stat().st_size == listing.files[name]
                    before = set(os.listdir(blobs)) if blobs.is_dir() else set()
                    begun = self._begun[name] = Begun(name, cached, before)
                    threading.Thread(target=self._download, args=(begun,), name=f"prequant-hub-early-{name}",
                                     daemon=True).start()
        except Exception as error:  # noqa: BLE001 - a head start only: convert() says what is wrong
            log.debug("no early download for %s: %s", repo_spec, error)

    def _download(self, begun: Begun) -> None:
        from ..hub import client

        assert self.listing is not None
        trace.mark(f"download-start:{begun.name}")
        try:
            path = client.download(self.listing, begun.name, large=True, limit=lambda: self._limit(begun.name))
        except BaseException as error:  # noqa: BLE001 - the adopting reader's to raise or to download again
            begun.result.set_exception(error)
            return
        trace.mark(f"download-done:{begun.name}")
        begun.result.set_result(path)
        with self._lock:
            forget = self._closed and not begun.adopted
        if forget:
            self._forget(begun)

    def _limit(self, name: str) -> int:
        """All of the shard (`hub.transfer`'s limit); raises once the head start is closed, which ends it."""
        if self._closed:
            raise Stopped(f"the early download of {name} stopped: the conversion ended")
        assert self.listing is not None
        return self.listing.files[name]

    def _forget(self, begun: Begun) -> None:
        """With `delete`, evict a finished shard no reader adopted, if the head start put it in the cache."""
        from ..hub import cache

        if not self.delete or begun.cached or begun.result.exception() is not None:
            return
        assert self.listing is not None
        blob = Path(begun.result.result()).resolve()
        if blob.name not in begun.blobs_before:
            cache.evict(self.listing.repo_id, self.listing.sha, begun.name)


def begin(source: str, *, delete: bool = False) -> HeadStart | None:
    """Begin downloading SOURCE's first shards when it names a Hub repo (not a local path); `delete`: the run deletes
    its downloads (--delete-source-shards). None where there is nothing to begin."""
    try:
        if Path(source).expanduser().exists():
            return None
    except (OSError, ValueError, RuntimeError):
        return None
    repo = hub_spec(source)
    if repo is None:
        return None
    from ..hub import client  # noqa: F401 - huggingface_hub, here: on the thread its import would wait behind torch's
    return HeadStart(repo[0], delete=delete)


__all__ = ["Begun", "HeadStart", "SHARDS", "Stopped", "begin"]
