"""Hub access through huggingface_hub: resolve a repo to a commit, download one file into the cache or take it out.

Settings are read from the environment at call time (HF_ENDPOINT, HF_HOME / HF_HUB_CACHE, HF_HUB_OFFLINE,
HF_TOKEN), not only when huggingface_hub was imported, so a library caller can change them between calls.
Every failure becomes one `PrequantError` line that names the repo (and the file) and says what to do
(worded by `failures`); tokens never appear in messages.
"""

from __future__ import annotations

import logging
import os
import re
import time
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from huggingface_hub import HfApi, hf_hub_download
from huggingface_hub.errors import (
    HfHubHTTPError,
    HFValidationError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils import validate_repo_id

from ..errors import PrequantError, UsageError
from ..util import holes
from . import cache, transfer
from .failures import IncompleteDownload, RemoteEntryNotFound, explain, first_line, is_incomplete, short

log = logging.getLogger(__name__)
T = TypeVar("T")

# huggingface_hub resumes a body cut mid-way (5 times in a row) and retries 408/429, but not a 5xx: a cut
# whose resume is answered 502/503 (a CDN or the Hub in trouble) fails the download, and huggingface_hub (1.33 and
# 2.4 read) deletes the partial file then. So a transient failure is tried again after waits that double from
# _FIRST_WAIT_S up to _LONGEST_WAIT_S, until they add up to PREQUANT_HUB_RETRY_S (default 120 s): a Grok-1 shard
# is 33 GB, and a run that gives up during a two-minute outage costs the user more than the wait.
_FIRST_WAIT_S = 1.0
_LONGEST_WAIT_S = 30.0
RETRY_ENV = "PREQUANT_HUB_RETRY_S"
_DEFAULT_RETRY_S = 120.0
_RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
API_TIMEOUT_S = 60.0
# One download's own partial file (module doc), or a file a conversion set aside to free as it converts it.
_PARTIAL_RE = re.compile(r"[0-9a-f]+\.(?:[0-9a-f]{8}\.incomplete|prequant-freeing)")
_ASIDE = "prequant-freeing"  # blobs/<etag>.prequant-freeing: a name huggingface_hub never gives a file


@dataclass(frozen=True)
class HubCommit:
    """A Hub repo pinned to one commit, with every file of that commit and its size."""

    repo_id: str
    revision: str | None  # as requested (branch, tag or sha); None means the default branch
    sha: str  # resolved commit sha
    files: dict[str, int]  # path -> size in bytes


def parse_repo_spec(spec: str) -> tuple[str, str | None]:
    """Split ``org/name[@revision]`` into ``(repo_id, revision)``; raises `UsageError` if malformed."""
    repo_id, at, revision = spec.strip().partition("@")
    example = "expected org/name or org/name@revision, e.g. keyfan/grok-1-hf@main"
    if repo_id.count("/") != 1:
        raise UsageError(f"invalid Hub repo '{spec}': {example}")
    try:
        validate_repo_id(repo_id)
    except HFValidationError as error:
        raise UsageError(f"invalid Hub repo '{spec}': {first_line(str(error)).rstrip('.')}; {example}") from None
    if at and (not revision or re.search(r"\s", revision)):
        raise UsageError(f"invalid revision in '{spec}': {example}")
    return repo_id, revision or None


def resolve(
    repo_id: str, revision: str | None = None, *, token: str | None = None, alias: str | None = None
) -> HubCommit:
    """Resolve ``repo_id`` at ``revision`` to a commit sha and its file list, in one Hub call.

    With HF_HUB_OFFLINE set, resolves from the local cache instead. ``alias`` is the name the user typed
    (e.g. ``grok-1``), used only in messages.
    """
    label = _label(repo_id, revision, alias)
    if cache.offline():
        sha, files = cache.resolve_offline(repo_id, revision, label)
        return HubCommit(repo_id=repo_id, revision=revision, sha=sha, files=files)
    try:
        info = api(token).model_info(repo_id, revision=revision, files_metadata=True, timeout=API_TIMEOUT_S)
    except Exception as error:
        message = explain(error, f"resolve {label}", repo_id, revision, token, endpoint=cache.endpoint())
        raise PrequantError(message) from error
    files = {sibling.rfilename: sibling.size for sibling in info.siblings or []}
    if info.sha is None or info.siblings is None or any(size is None for size in files.values()):
        raise PrequantError(
            f"the Hub at {cache.endpoint()} returned no commit sha or file list for {label}; check that HF_ENDPOINT "
            "points to a Hugging Face Hub"
        )
    cache.keep_listing(repo_id, info.sha, info.siblings or [])
    return HubCommit(repo_id=repo_id, revision=revision, sha=info.sha, files=files)  # type: ignore[arg-type]


def download(source: HubCommit, filename: str, *, token: str | None = None, large: bool = False,
             limit: Callable[[], int] | None = None) -> Path:  # fmt: skip
    """Download ``filename`` at ``source.sha`` into the Hugging Face cache and return its local path.

    Transient failures are retried a few times; a failed or incomplete download raises `PrequantError`
    naming the file (a shard is never silently skipped). ``large``: a weight shard, whose body prequant transfers
    itself unless Xet stores it (`transfer`: huggingface_hub's loop is slower than the link). ``limit``: how many
    bytes of the file may be on disk so far (`transfer`'s); a file huggingface_hub downloads, which writes all of
    it at once, waits until the whole file is allowed.
    """
    label = f"{filename} of {source.repo_id}@{source.sha[:12]}"
    if filename not in source.files:
        raise PrequantError(
            f"{source.repo_id} has no file {filename} at commit {source.sha}; the repo lists {len(source.files)} files"
        )
    def attempt() -> Path:
        remove_stale_partials(source.repo_id)  # e.g. of a run killed mid-download: they would fill the disk
        try:
            return _fetch(source, filename, token, large, limit)
        except Exception as error:
            if cache.offline():
                raise cache.not_cached_offline(f"download {label}") from error
            raise

    path = _retrying(attempt, f"download {label}", source, token)
    cache.remember(source.repo_id, source.revision, source.sha)
    return path


def cache_path(source: HubCommit, filename: str) -> Path:
    """Where `download` puts ``filename`` (its snapshot path in the cache), whether it is there yet or not."""
    return cache.snapshot_path(source.repo_id, source.sha, filename)


def read_range(source: HubCommit, filename: str, start: int, end: int, *, token: str | None = None) -> bytes:
    """Bytes ``[start, end)`` of ``filename`` at ``source.sha``, by an HTTP range request (retried like `download`)."""
    from huggingface_hub import hf_hub_url
    from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

    label = f"{filename} of {source.repo_id}@{source.sha[:12]}"
    if cache.offline():
        raise cache.not_cached_offline(f"read {label}")
    url = hf_hub_url(source.repo_id, filename, revision=source.sha, endpoint=cache.endpoint())
    headers = {**build_hf_headers(token=token, library_name="prequant"), "Range": f"bytes={start}-{end - 1}"}

    def attempt() -> bytes:
        with get_session().stream("GET", url, headers=headers, timeout=API_TIMEOUT_S) as response:
            if response.status_code >= 400:
                response.read()  # the error's message is in the body
            hf_raise_for_status(response)
            partial = response.status_code == 206
            want, body = (end - start if partial else end), bytearray()
            for chunk in response.iter_bytes():  # a server ignoring Range sends it all: stop at `end`
                body += chunk
                if len(body) >= want:
                    break
        data = bytes(body[:want] if partial else body[start:end])
        if len(data) != end - start:
            raise IncompleteDownload(f"got {len(data)} bytes of the {end - start} asked for")
        return data

    return _retrying(attempt, f"read {label}", source, token)


def retry_waits(budget_s: float | None = None) -> list[float]:
    """The waits between attempts: doubling from 1 s, at most 30 s each, adding up to at most `budget_s`
    (default: PREQUANT_HUB_RETRY_S, else 120 s; 0 tries once)."""
    if budget_s is None:
        try:
            budget_s = float(os.environ.get(RETRY_ENV, _DEFAULT_RETRY_S))
        except ValueError:
            budget_s = _DEFAULT_RETRY_S
    waits: list[float] = []
    wait = _FIRST_WAIT_S
    while sum(waits) + wait <= budget_s:
        waits.append(wait)
        wait = min(2 * wait, _LONGEST_WAIT_S)
    if sum(waits) < budget_s:  # the remainder, so that the waits fill the budget
        waits.append(budget_s - sum(waits))
    return waits


def _retrying(attempt: Callable[[], T], action: str, source: HubCommit, token: str | None) -> T:
    """`attempt()`, tried again after each of `retry_waits()` while it fails transiently; a PrequantError as it
    is, any other failure explained as one that names `action` (and, after retries, how long they went on)."""
    waits = retry_waits()
    started = time.monotonic()
    for tried, wait in enumerate((*waits, None), start=1):
        try:
            return attempt()
        except PrequantError:
            raise
        except Exception as error:
            if wait is None or not _is_transient(error):
                message = explain(error, action, source.repo_id, source.sha, token, endpoint=cache.endpoint())
                raise PrequantError(message + _tried(tried, time.monotonic() - started)) from error
            log.warning("%s failed (%s); retrying in %.0fs", action, short(error, token), wait)
            time.sleep(wait)
    raise AssertionError("unreachable")


def _tried(tries: int, seconds: float) -> str:
    """What a failure's message adds once it was retried: how often, how long, and the setting for it."""
    if tries <= 1:
        return ""
    return f" (tried {tries} times over {seconds:.0f} s; {RETRY_ENV} sets how long to keep trying)"


def evict(source: HubCommit, filename: str) -> None:
    """Delete a downloaded file (its snapshot pointer and blob) from the cache; does nothing if absent."""
    pointer = cache_path(source, filename)
    if pointer.is_symlink():
        blob = Path(os.path.normpath(pointer.parent / os.readlink(pointer)))
        pointer.unlink()
        if blob.parent == cache.blobs_folder(source.repo_id):  # never follow a link out of this repo's cache
            blob.unlink(missing_ok=True)
    elif pointer.is_file():  # no-symlink caches keep the file itself in the snapshot
        pointer.unlink()


class SetAside:
    """A downloaded file out of the cache while a conversion frees it (`set_aside`): its path, a descriptor open for
    writing (holes need one), and its etag's lock, held until `drop`."""

    def __init__(self, path: Path, lock) -> None:
        self.path, self._lock = path, lock
        self._guard = threading.Lock()  # the descriptor is never closed while a hole is punched through it
        try:
            self._fd: int | None = os.open(path, os.O_WRONLY)
        except OSError as e:
            log.debug("cannot open %s to free its converted parts (%s)", path, e)
            self._fd = None

    def free(self, ranges: Iterable[tuple[int, int]]) -> int:
        """Give the whole blocks of these byte ranges back to the disk (`util.holes.punch`); the bytes freed (0 once
        dropped). Raises `util.holes.Unsupported` where the filesystem cannot, OSError for another failure."""
        with self._guard:
            if self._fd is None:
                return 0
            return sum(holes.punch(self._fd, start, end) for start, end in ranges)

    def drop(self) -> None:
        """Delete the file (its space goes once nothing holds it open) and release the lock."""
        with self._guard:
            fd, self._fd = self._fd, None
            try:
                if fd is not None:
                    os.close(fd)
                self.path.unlink(missing_ok=True)
            finally:
                self._lock.release()


def set_aside(source: HubCommit, filename: str) -> SetAside | None:
    """Take a downloaded file out of the cache to free it as it is converted: its snapshot link deleted, its blob
    renamed ``blobs/<etag>.prequant-freeing`` (a name huggingface_hub never takes for a file, and which stays visible
    to the CPU workers, which open a source by its path), under the etag's lock. So a file with holes never looks
    complete in the cache, and one a killed run left is removed by `remove_stale_partials` once its lock is free.
    None where it cannot: not a link to this repo's blobs (a cache without links), or the lock held elsewhere."""
    from filelock import FileLock, Timeout  # huggingface_hub's own lock library

    pointer = cache_path(source, filename)
    if not pointer.is_symlink():
        return None
    blob = Path(os.path.normpath(pointer.parent / os.readlink(pointer)))
    if blob.parent != cache.blobs_folder(source.repo_id) or not blob.is_file():
        return None
    lock = FileLock(str(cache.lock_path(source.repo_id, blob.name)), timeout=0)
    try:
        lock.acquire()
    except (Timeout, OSError):
        return None
    try:
        aside = blob.with_name(f"{blob.name}.{_ASIDE}")
        pointer.unlink()  # first: a run killed between the two leaves the blob whole, merely unlinked
        os.replace(blob, aside)
    except OSError:
        lock.release()
        return None
    return SetAside(aside, lock)


def remove_stale_partials(repo_id: str) -> list[str]:
    """Delete the repo's partial downloads that no download is writing; return their names.

    huggingface_hub (1.33 and 2.4 read) downloads each file into ``blobs/<etag>.<8 hex>.incomplete``, a name of its
    own for each download, while it holds ``.locks/<repo folder>/<etag>.lock``, and deletes the partial file when
    the download fails; but a process killed mid-download (SIGKILL, a machine that lost power) leaves it behind,
    never to be reused: with 33 GB shards, a few such kills fill the disk that `--delete-source-shards` was
    bounding. A partial file whose lock this process can take is one no download is writing (the lock is the
    kernel's flock, released when its holder dies), so it goes; one whose lock is held stays. Earlier
    huggingface_hub releases wrote ``<etag>.incomplete`` and resumed it on the next download: those are never
    touched. A file a conversion set aside (`set_aside`) goes the same way: its lock is held while it is used."""
    from filelock import FileLock, Timeout  # huggingface_hub's own lock library

    try:
        partials = sorted(p for p in cache.blobs_folder(repo_id).iterdir() if _PARTIAL_RE.fullmatch(p.name))
    except OSError:
        return []
    removed = []
    for partial in partials:
        etag = partial.name.split(".", 1)[0]
        lock = FileLock(str(cache.lock_path(repo_id, etag)), timeout=0)
        try:
            with lock:
                partial.unlink(missing_ok=True)
        except (Timeout, OSError):
            continue  # being written (or a cache we cannot lock): not ours to delete
        removed.append(partial.name)
    if removed:
        log.info("removed %d stale partial download(s) of %s: %s", len(removed), repo_id, ", ".join(removed))
    return removed


def api(token: str | None) -> HfApi:
    """huggingface_hub's API client for the endpoint set now (HF_ENDPOINT), as prequant."""
    return HfApi(endpoint=cache.endpoint(), token=token, library_name="prequant")


def _label(repo_id: str, revision: str | None, alias: str | None) -> str:
    spec = repo_id + (f"@{revision}" if revision else "")
    return f"{alias} ({spec})" if alias else spec


# --------------------------------------------------------------------------------------- downloading


def _fetch(source: HubCommit, filename: str, token: str | None, large: bool,
           limit: Callable[[], int] | None = None) -> Path:  # fmt: skip
    # Pinned to the sha: a cached file is returned without any network call.
    pointer = cache_path(source, filename)
    path = None
    if large and transfer.enabled() and not cache.offline() and not pointer.is_file():
        try:
            path = transfer.download(source.repo_id, source.sha, filename, token=token, waits=retry_waits(),
                                     limit=limit)
        except transfer.TransferFailed as failed:  # its retries are spent: said as the last failure, with them
            action = f"download {filename} of {source.repo_id}@{source.sha[:12]}"
            message = explain(failed.cause, action, source.repo_id, source.sha, token, endpoint=cache.endpoint())
            raise PrequantError(message + _tried(failed.tries, failed.seconds)) from failed
    if path is None and limit is not None and not pointer.is_file():
        transfer.allowed(limit, source.files[filename] - 1)  # huggingface_hub writes the file whole
    path = path or Path(
        hf_hub_download(
            source.repo_id,
            filename,
            revision=source.sha,
            cache_dir=cache.cache_dir(),
            endpoint=cache.endpoint(),
            token=token,
            local_files_only=cache.offline(),
            library_name="prequant",
        )
    )
    size, expected = path.stat().st_size, source.files[filename]
    if size != expected:
        evict(source, filename)  # never leave a wrong-sized file for the next run to trust
        raise IncompleteDownload(f"got {size} bytes, the Hub lists {expected}")
    return path


def _is_transient(error: BaseException) -> bool:
    if isinstance(error, (RepositoryNotFoundError, RevisionNotFoundError, RemoteEntryNotFound)):
        return False
    if isinstance(error, HfHubHTTPError):
        return error.response is not None and error.response.status_code in _RETRY_STATUSES
    return is_incomplete(error)


__all__ = [
    "HubCommit", "SetAside", "api", "cache_path", "download", "evict", "parse_repo_spec", "read_range",
    "remove_stale_partials", "resolve", "retry_waits", "set_aside",
]
