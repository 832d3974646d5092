"""A Hub source's first shard, begun from the CLI before torch is imported.

A cold process spends seconds importing torch, CUDA and bitsandbytes before `convert()` resolves anything (2 s
on the GPU machine with the libraries in the page cache, 10 s without). For a local source the disk reads ahead
meanwhile (`conversion.readahead`); for a Hub source this does the same for the network: on a thread, it resolves
the repo (one API call), downloads its index and begins the first shard the plan will read (the index's first),
through the same download child the conversion then takes over (`hub.fetcher.adopt`), so nothing is fetched
twice and the shard counts as this run's download (`--delete-source-shards` deletes it like the others).

Standard library and huggingface_hub only. Purely a head start: any failure here is ignored, and `convert()`
resolves and reports everything itself. A run that stops before it reaches its downloads (a refused OUTPUT_DIR,
say) ends the begun download with `close`, which convert() calls: the partial file is removed, and a finished
shard too when the run was to delete its downloads.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from ..checkpoint.hf_files import shard_names, weight_layout
from ..util import trace
from .spec import hub_spec

log = logging.getLogger(__name__)

_delete: list[bool] = []  # per early start: whether its run deletes its downloads


def start(spec: str, *, delete: bool = False) -> bool:
    """Begin downloading SPEC's first weight shard, if SPEC names a Hub repo (not a local path); `delete`: the run
    will delete its downloads (`--delete-source-shards`). Whether it began."""
    try:
        if Path(spec).expanduser().exists():
            return False
    except (OSError, ValueError, RuntimeError):
        return False
    repo = hub_spec(spec)
    if repo is None:
        return False
    from ..hub import fetcher

    done = fetcher.expect_early()
    _delete.append(delete)
    threading.Thread(target=_begin, args=(repo[0], done), name="prequant-hub-early", daemon=True).start()
    return True


def _begin(repo_spec: str, done: threading.Event) -> None:
    from ..hub import client, fetcher

    early = None
    try:
        repo_id, revision = client.parse_repo_spec(repo_spec)
        listing = client.resolve(repo_id, revision)
        layout = weight_layout(listing.files)  # what hub_repo.resolve will find
        if layout is None:
            return
        index, single, _ = layout
        first = shard_names(repo_id, client.download(listing, index))[0] if index else single
        if first in listing.files:
            early = fetcher.Fetcher(listing)
            early.begin(first)
            fetcher.keep_early(early)
            trace.mark(f"download-begun-early:{first}")
    except Exception as error:  # noqa: BLE001 - a head start only: convert() says what is wrong
        log.debug("no early download for %s: %s", repo_spec, error)
    finally:
        done.set()
    if early is not None:
        # The download child dies with the thread that started it (hub.fetcher): this one lives until the
        # conversion that took it over, or `close`, has ended it.
        early.ended.wait()


def close() -> None:
    """End what the early start began and no conversion took over (convert() calls this as it ends): a download
    still running is cut and its partial file removed; a finished one is evicted when the run was to delete its
    downloads, kept in the cache otherwise (as any downloaded shard)."""
    if not _delete:
        return
    from ..hub import client, fetcher

    delete = any(_delete)
    _delete.clear()
    fetcher.wait_early()
    for source, done in fetcher.close_early():
        if delete and done.fresh:
            client.evict(source, done.filename)
