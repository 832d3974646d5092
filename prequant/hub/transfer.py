"""A weight file's download at the link's speed: one connection, its body read straight into a buffer and written
as it arrives.

huggingface_hub reads a plain HTTP download (one that is not Xet-backed: a mirror, a private Hub, an LFS file
behind a proxy) through its HTTP client in small pieces, each passing through Python. Here the standard library's
HTTP client reads what the socket holds into a large buffer in C (`readinto1`: one receive, the GIL released while
it waits) and each piece goes to disk in one write, so a connection that fails mid-body loses no byte it delivered.

Only the body's transfer is prequant's. huggingface_hub still answers where the file is (`get_hf_file_metadata`:
the commit, the etag, the size, the CDN URL after the Hub's redirect, whether Xet stores it), and the file lands
where huggingface_hub would put it: ``blobs/<etag>``, through ``blobs/<etag>.incomplete``, under the lock
``.locks/<repo folder>/<etag>.lock``, with ``snapshots/<sha>/<name>`` linking to it. A Xet-backed file (the Hub's
own storage, when hf_xet is installed) is left to huggingface_hub: hf_xet fetches its chunks in parallel already.

A body cut mid-way is resumed from the byte on disk (a ranged request); a passing failure (a refused, reset or
timed-out connection, 408, 429, 5xx) is tried again after the waits the caller gives, those starting over each
time bytes come. The partial file outlives a failure or a kill: the next download of the file, in this run or the
next, continues from its last byte.

A download may be given `proceed`, called before each read of the body, which raises to stop it there; its partial
file stays for the next download to resume. The streaming reader (`source.hub_stream`) stops its downloads this way
when it closes (the conversion ended or failed). Its bound on scratch disk needs nothing here: it starts a download
only once the whole file fits.
"""

from __future__ import annotations

import http.client
import importlib.util
import logging
import os
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from urllib.parse import urlsplit

from ..errors import PrequantError
from ..util import failpoints
from . import cache
from .failures import IncompleteDownload, is_transient, short

log = logging.getLogger(__name__)

_BUFFER = 16 << 20  # the most one read takes: what a fast link delivers between two reads fits in one write


class TransferFailed(Exception):
    """A download that could not finish: `cause` is the last failure (an HTTP answer, a network error, a short
    body), `tries` how many requests were made, `seconds` since the first."""

    def __init__(self, cause: BaseException, tries: int, seconds: float) -> None:
        super().__init__(str(cause))
        self.cause, self.tries, self.seconds = cause, tries, seconds


def download(repo_id: str, sha: str, filename: str, *, token: str | None, waits: Sequence[float],
             proceed: Callable[[], None] | None = None) -> Path | None:  # fmt: skip
    """Download ``filename`` of ``repo_id`` at commit ``sha`` into the Hugging Face cache and return its snapshot
    path; None where huggingface_hub should download it instead (Xet-backed with hf_xet, no etag or size, or its
    blob is in the cache already: huggingface_hub links it without a download).

    huggingface_hub's errors for the metadata request (no such file, 401, a 5xx, a reset) are raised as they are, for
    the caller's retries and messages; a body that cannot be completed raises `TransferFailed` after the waits.
    ``proceed``: see the module docstring (None: the download goes on to its end)."""
    from filelock import FileLock  # huggingface_hub's own lock library: the same lock as its downloads
    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url
    from huggingface_hub.utils import build_hf_headers

    url = hf_hub_url(repo_id, filename, revision=sha, endpoint=cache.endpoint())
    meta = get_hf_file_metadata(url, token=token, endpoint=cache.endpoint(), library_name="prequant")
    if meta.xet_file_data is not None and importlib.util.find_spec("hf_xet") and not constants.HF_HUB_DISABLE_XET:
        return None
    if meta.etag is None or meta.size is None or meta.location is None:
        return None
    blob = cache.blobs_folder(repo_id) / meta.etag
    if blob.exists():
        return None
    headers = build_hf_headers(token=token, library_name="prequant")
    headers["Accept-Encoding"] = "identity"  # the bytes as stored: the size is the file's
    if urlsplit(meta.location).netloc != urlsplit(url).netloc:
        headers.pop("authorization", None)  # a signed CDN URL: the token stays with the Hub, as huggingface_hub does
    lock = cache.lock_path(repo_id, meta.etag)
    lock.parent.mkdir(parents=True, exist_ok=True)
    blob.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(lock)):
        if not blob.exists():  # another process may have finished it while this one waited for the lock
            partial = blob.with_name(f"{meta.etag}.incomplete")  # resumed by the next download (module doc)
            try:
                with open(partial, "ab", buffering=0) as out:  # created with the umask's permissions
                    if out.tell() > meta.size:  # not this file's beginning: start again
                        out.seek(0)
                        out.truncate()
                    elif out.tell():
                        log.info("%s: resuming from byte %d of %d on disk", filename, out.tell(), meta.size)
                    fetch(meta.location, headers, out, meta.size, waits, label=filename,
                          timeout=constants.HF_HUB_DOWNLOAD_TIMEOUT, proceed=proceed)
            except BaseException:
                if partial.stat().st_size == 0:  # nothing to resume from
                    partial.unlink()
                raise
            os.replace(partial, blob)
            failpoints.hit("blob-downloaded")
        pointer = cache.snapshot_path(repo_id, sha, filename)
        _link(blob, pointer)
    return pointer


def fetch(url: str, headers: dict[str, str], out, size: int, waits: Sequence[float], *, label: str,
          timeout: float = 10.0, proceed: Callable[[], None] | None = None) -> None:  # fmt: skip
    """Write the ``size``-byte body of ``url`` to the unbuffered file ``out`` from its position on (the bytes before
    it are the body's start), resuming cut bodies and retrying passing failures after ``waits`` (see the module doc);
    raise `TransferFailed` once they are spent, any other failure as it is.

    Each request starts at ``out``'s position: every byte received is written before a failure is handled.
    ``proceed()``, if given, is called before each read and raises to stop (module docstring)."""
    tries, started = 0, time.monotonic()
    pauses: Iterator[float] = iter(waits)
    buffer = memoryview(bytearray(_BUFFER))
    bar = _progress(label, size)
    if bar is not None and out.tell():
        bar.update(out.tell())
    try:
        while out.tell() < size:
            tries += 1
            before = out.tell()
            try:
                _body(url, headers, out, size, buffer, timeout, bar, label, proceed)
                if out.tell() == size:
                    return
                failure: BaseException = IncompleteDownload(f"the body stopped at byte {out.tell()} of {size}")
            except Exception as error:
                if isinstance(error, urllib.error.HTTPError):
                    error.read()  # the error's message, so that the connection can close cleanly
                    if not is_transient(error):
                        raise TransferFailed(error, tries, time.monotonic() - started) from error
                elif not is_transient(error):  # a full disk, a stopped download: no retry mends them
                    raise
                failure = error
            if out.tell() > before:  # bytes came: a cut is resumed at once, and the waits start over
                pauses = iter(waits)
                log.info("%s: the body was cut at %d of %d bytes (%s); resuming", label, out.tell(), size,
                         short(failure, None))
                continue
            pause = next(pauses, None)
            if pause is None:
                raise TransferFailed(failure, tries, time.monotonic() - started) from failure
            log.warning("download of %s failed (%s); retrying in %.0fs", label, short(failure, None), pause)
            time.sleep(pause)
    finally:
        if bar is not None:
            bar.close()


def _body(url: str, headers: dict[str, str], out, size: int, buffer: memoryview, timeout: float, bar,
          label: str, proceed: Callable[[], None] | None = None) -> None:  # fmt: skip
    """One request for the rest of the body, from ``out``'s position on, written to ``out``."""
    done = out.tell()
    request = urllib.request.Request(url, headers={**headers, **({"Range": f"bytes={done}-"} if done else {})})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        if done and response.status == 200:  # the server ignored the Range: the whole body again
            out.seek(0)
            out.truncate()
            if bar is not None:
                bar.update(-done)
            done = 0
        elif done and not _starts_at(response.headers.get("Content-Range"), done, size):
            raise http.client.HTTPException(f"asked for bytes {done}- and got {response.headers.get('Content-Range')}")
        length = response.headers.get("Content-Length")
        if length is not None and int(length) != size - done:
            raise PrequantError(
                f"{label}: the server sends {int(length) + done} bytes where the Hub lists {size}; the file "
                "changed on the server, run again"
            )
        # The socket's own buffered reader, past the headers: one receive per call, so nothing received waits in a
        # buffer when the connection fails. A chunked body goes through the response, which decodes it.
        read = response.readinto if response.chunked or length is None else response.fp.readinto1
        while done < size:
            if proceed is not None:
                proceed()
            n = read(buffer[: min(_BUFFER, size - done)])
            if not n:
                return
            view = buffer[:n]
            while view:  # a write to a regular file is whole unless the disk is full (then it raises)
                view = view[out.write(view):]
            done += n
            if bar is not None:
                bar.update(n)


def _starts_at(content_range: str | None, start: int, size: int) -> bool:
    """Whether a 206's Content-Range is ``bytes START-(size-1)/size``."""
    return content_range is not None and content_range.replace(" ", "").lower() == f"bytes{start}-{size - 1}/{size}"


def _progress(label: str, size: int):
    """huggingface_hub's own download bar for the file (none where its bars are disabled)."""
    from huggingface_hub.utils import are_progress_bars_disabled, tqdm

    if are_progress_bars_disabled():
        return None
    return tqdm(total=size, unit="B", unit_scale=True, unit_divisor=1024, desc=label[-40:],
                name="huggingface_hub.http_get")  # fmt: skip


def _link(blob: Path, pointer: Path) -> None:
    """``snapshots/<sha>/<name>`` -> ``../../blobs/<etag>`` (relative, as huggingface_hub links); where links
    cannot be made, the file itself moves there, as huggingface_hub does then."""
    pointer.parent.mkdir(parents=True, exist_ok=True)
    pointer.unlink(missing_ok=True)
    try:
        os.symlink(os.path.relpath(blob, pointer.parent), pointer)
    except OSError:
        os.replace(blob, pointer)


__all__ = ["TransferFailed", "download", "fetch"]
