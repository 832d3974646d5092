"""Hub API calls through huggingface_hub: resolve a repo to a commit, download a file into the cache, read a byte
range. Every passing failure (`failures.is_transient`) is tried again after waits that double from 1 s up to 30 s,
for `settings.hub_retry_s()` in all: a Hub incident lasts tens of seconds, and a rerun of a 600 GB conversion costs
more than the wait.

Settings are read from the environment at call time (HF_ENDPOINT, HF_HOME / HF_HUB_CACHE, HF_HUB_OFFLINE,
HF_TOKEN), not only when huggingface_hub was imported, so a library caller can change them between calls.
Every failure becomes one `PrequantError` line that names the repo (and the file) and says what to do
(worded by `failures`); tokens never appear in messages.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from huggingface_hub import HfApi, hf_hub_download
from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id

from .. import settings
from ..errors import PrequantError, UsageError
from . import cache, transfer
from .failures import IncompleteDownload, explain, first_line, is_transient, short

log = logging.getLogger(__name__)
T = TypeVar("T")

_FIRST_WAIT_S = 1.0
_LONGEST_WAIT_S = 30.0
API_TIMEOUT_S = 60.0


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
    spec = repo_id + (f"@{revision}" if revision else "")
    label = f"{alias} ({spec})" if alias else spec
    if cache.offline():
        sha, files = cache.resolve_offline(repo_id, revision, label)
        return HubCommit(repo_id=repo_id, revision=revision, sha=sha, files=files)
    info = retrying(lambda: api(token).model_info(repo_id, revision=revision, files_metadata=True,
                                                  timeout=API_TIMEOUT_S),
                    f"resolve {label}", repo_id, revision, token)  # fmt: skip
    files = {sibling.rfilename: sibling.size for sibling in info.siblings or []}
    if info.sha is None or info.siblings is None or any(size is None for size in files.values()):
        raise PrequantError(
            f"the Hub at {cache.endpoint()} returned no commit sha or file list for {label}; check that HF_ENDPOINT "
            "points to a Hugging Face Hub"
        )
    cache.keep_listing(repo_id, info.sha, info.siblings or [])
    return HubCommit(repo_id=repo_id, revision=revision, sha=info.sha, files=files)  # type: ignore[arg-type]


def download(source: HubCommit, filename: str, *, token: str | None = None, large: bool = False,
             proceed: Callable[[], None] | None = None) -> Path:  # fmt: skip
    """Download ``filename`` at ``source.sha`` into the Hugging Face cache and return its local path.

    A failed or incomplete download raises `PrequantError` naming the file (a shard is never silently skipped).
    ``large``: a weight file, whose body prequant transfers itself unless Xet stores it (`transfer`). ``proceed``:
    raises to stop the download (`transfer.fetch`'s, called before each read); a file huggingface_hub downloads is
    not stopped once begun, so it is asked once before.
    """
    label = f"{filename} of {source.repo_id}@{source.sha[:12]}"
    if filename not in source.files:
        raise PrequantError(
            f"{source.repo_id} has no file {filename} at commit {source.sha}; the repo lists {len(source.files)} files"
        )

    def attempt() -> Path:
        cache.remove_stale_partials(source.repo_id)  # e.g. of a run killed mid-download: they would fill the disk
        try:
            return _fetch(source, filename, token, large, proceed)
        except Exception as error:
            if cache.offline():
                raise cache.not_cached_offline(f"download {label}") from error
            raise

    path = retrying(attempt, f"download {label}", source.repo_id, source.sha, token)
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

    return retrying(attempt, f"read {label}", source.repo_id, source.sha, token)


def retry_waits(budget_s: float | None = None) -> list[float]:
    """The waits between attempts: doubling from 1 s, at most 30 s each, adding up to at most `budget_s`
    (default: `settings.hub_retry_s()`; 0 tries once)."""
    budget_s = settings.hub_retry_s() if budget_s is None else budget_s
    waits: list[float] = []
    wait = _FIRST_WAIT_S
    while sum(waits) + wait <= budget_s:
        waits.append(wait)
        wait = min(2 * wait, _LONGEST_WAIT_S)
    if sum(waits) < budget_s:  # the remainder, so that the waits fill the budget
        waits.append(budget_s - sum(waits))
    return waits


def retrying(attempt: Callable[[], T], action: str, repo_id: str, revision: str | None, token: str | None, *,
             writing: bool = False) -> T:
    """`attempt()`, tried again after each of `retry_waits()` while it fails transiently; a PrequantError as it
    is, any other failure explained as one line that names `action` (and, after retries, how long they went on).
    ``writing``: the call changes the repo (a refusal then asks for write access)."""
    waits = retry_waits()
    started = time.monotonic()
    for tried, wait in enumerate((*waits, None), start=1):
        try:
            return attempt()
        except PrequantError:
            raise
        except Exception as error:
            if wait is None or not is_transient(error):
                message = explain(error, action, repo_id, revision, token, endpoint=cache.endpoint(), writing=writing)
                raise PrequantError(message + tried_for(tried, time.monotonic() - started)) from error
            log.warning("%s failed (%s); retrying in %.0fs", action, short(error, token), wait)
            time.sleep(wait)
    raise AssertionError("unreachable")


def tried_for(tries: int, seconds: float) -> str:
    """What a failure's message adds once it was retried: how often, how long, and the setting for it."""
    if tries <= 1:
        return ""
    return (f" (tried {tries} times over {seconds:.0f} s; run the command again once the Hub answers, or set "
            f"{settings.HUB_RETRY_S} to keep trying longer)")


def api(token: str | None) -> HfApi:
    """huggingface_hub's API client for the endpoint set now (HF_ENDPOINT), as prequant."""
    return HfApi(endpoint=cache.endpoint(), token=token, library_name="prequant")


def _fetch(source: HubCommit, filename: str, token: str | None, large: bool,
           proceed: Callable[[], None] | None) -> Path:  # fmt: skip
    # Pinned to the sha: a cached file is returned without any network call.
    pointer = cache_path(source, filename)
    path = None
    if large and not cache.offline() and not pointer.is_file():
        try:
            path = transfer.download(source.repo_id, source.sha, filename, token=token, waits=retry_waits(),
                                     proceed=proceed)
        except transfer.TransferFailed as failed:  # its retries are spent: said as the last failure, with them
            action = f"download {filename} of {source.repo_id}@{source.sha[:12]}"
            message = explain(failed.cause, action, source.repo_id, source.sha, token, endpoint=cache.endpoint())
            raise PrequantError(message + tried_for(failed.tries, failed.seconds)) from failed
    if path is None and proceed is not None and not pointer.is_file():
        proceed()  # huggingface_hub's download cannot be stopped once begun: asked once, before it
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
        cache.evict(source.repo_id, source.sha, filename)  # never leave a wrong-sized file for the next run to trust
        raise IncompleteDownload(f"got {size} bytes, the Hub lists {expected}")
    return path


__all__ = [
    "HubCommit", "api", "cache_path", "download", "parse_repo_spec", "read_range", "resolve", "retry_waits",
    "retrying",
]
