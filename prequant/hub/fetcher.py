"""Shard downloads in a child process, so that they do not share the converting process' GIL.

huggingface_hub's download loop takes the GIL for every chunk it writes. In the converting process the
GIL is also taken, call after call, by the CPU kernel's threads, the reader, the writer and the hashing, and
each time the download thread waits for its turn the connection idles. Measured: a streamed conversion on
the GPU machine took shards at 0.40-0.51 GB/s where huggingface_hub alone downloaded 0.64 GB/s from the same
server, and on the 2-core machine one busy Python thread cut a download from 0.17-0.20 to 0.009 GB/s.

`Fetcher` keeps one child (``python -m prequant.hub.fetcher``) that runs `client.download` for each request (a
weight shard: its body transferred by `transfer`),
one at a time: a JSON line in, a JSON line out with the path or the pickled error (`PrequantError` crosses
processes with its parts). Settings (HF_ENDPOINT, HF_TOKEN, HF_HUB_OFFLINE, the cache) come with the
environment; huggingface_hub's own output goes to the same stderr. The child ignores SIGINT (the parent
decides how a Ctrl-C ends) and dies with the thread that started it (Linux: PR_SET_PDEATHSIG), so a killed
conversion leaves no download running. Where no child can be started, downloads run in this process.

A download can be begun early (`begin`: the request is sent, its answer read by the `download` of the same file
later) by a Fetcher that the conversion then takes over (`keep_early`, `adopt`): the CLI begins a Hub source's
first shard before it imports torch (`source.hub_early`). Each answer says whether this download put the file in
the cache (`Fetched.fresh`), judged when its request was sent: only such files are a conversion's to delete.

A download asked for with ``limited=True`` writes at most `set_limit`'s bytes of its file so far (`transfer`'s
``limit``): the parent keeps the number in a memfd the child inherits (8 bytes, read before each buffer), which
`source.hub_stream` raises as the shard before is freed. Where there is no memfd (not Linux), `limits` is False
and every download is whole.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

from ..errors import PrequantError
from . import client

log = logging.getLogger(__name__)

_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])  # the directory holding this prequant
_EXIT_WAIT_S = 2.0  # for an idle child to see its stdin close and exit, before it is killed
_UNLIMITED = (1 << 63) - 1
_LIMIT = struct.Struct("<q")  # the limit's bytes in the memfd


@dataclass(frozen=True)
class Fetched:
    """A downloaded file: its path in the cache, and whether this download put it there (it was not complete in the
    cache, and its blob did not exist, when the request was sent)."""

    filename: str
    path: Path
    fresh: bool


class _Pending:
    """A request sent and not yet answered: the file, and what the cache held when it was sent."""

    def __init__(self, source: client.HubCommit, filename: str) -> None:
        self.filename = filename
        target = client.cache_path(source, filename)
        self.cached = target.is_file() and target.stat().st_size == source.files.get(filename)
        blobs = target.parents[2] / "blobs"  # <repo>/snapshots/<sha>/<name> -> <repo>/blobs
        self.before = set(os.listdir(blobs)) if blobs.is_dir() else set()

    def fetched(self, path: Path) -> Fetched:
        return Fetched(self.filename, path, not self.cached and path.resolve().name not in self.before)


class Fetcher:
    """Downloads files of one commit through a child process (started on the first download)."""

    def __init__(self, source: client.HubCommit) -> None:
        self.source = source
        self._proc: subprocess.Popen[str] | None = None
        self._lock = threading.Lock()
        self._in_process = False
        self._pending: _Pending | None = None  # a request in flight (its answer not read yet)
        self._unclaimed: dict[str, Fetched] = {}  # begun downloads answered before their `download` came
        self._limit_fd = _limit_memfd()  # the limit of a limited download, for the child to read
        self._closed = False
        self.ended = threading.Event()  # set by `close`: the thread that started the child may end now

    @property
    def _busy(self) -> bool:
        return self._pending is not None

    @property
    def limits(self) -> bool:
        """Whether this Fetcher's downloads can be held to a limit (`set_limit`)."""
        return self._limit_fd is not None

    def set_limit(self, nbytes: int) -> None:
        """From now on, a limited download may have `nbytes` of its file on disk (set it before `download`)."""
        with self._lock:  # never on a descriptor `close` has closed (its number may be another file's by then)
            if self._limit_fd is not None:
                os.pwrite(self._limit_fd, _LIMIT.pack(nbytes), 0)

    def _read_limit(self) -> int:
        """The limit, read here (a download in this process); none once closed."""
        with self._lock:
            return _UNLIMITED if self._limit_fd is None else _read(self._limit_fd)

    def begin(self, filename: str) -> None:
        """Send the request for `filename` now; `download(filename)` reads its answer."""
        proc = self._child()
        if proc is None or self._pending is not None:
            return  # in this process downloads cannot run ahead; one request at a time
        self._send(proc, _Pending(self.source, filename))

    def download(self, filename: str, *, limited: bool = False) -> Fetched:
        """`client.download(source, filename)`, run in the child: the file, or its error raised here. `limited`:
        held to `set_limit` (where `limits`); a download begun early (`begin`) never is."""
        limited = limited and self.limits
        proc = self._child()
        if proc is None:
            pending = _Pending(self.source, filename)
            limit = self._read_limit if limited else None
            return pending.fetched(client.download(self.source, filename, large=True, limit=limit))
        if filename in self._unclaimed:
            return self._unclaimed.pop(filename)
        if self._pending is not None and self._pending.filename != filename:
            # A begun download of another file (the plan reads the shards in another order after all): its
            # answer is kept for the `download` that asks for it, with its `fresh` as judged when it began.
            begun = self._pending.filename
            try:
                self._unclaimed[begun] = self._answer(proc)
            except Exception as error:  # noqa: BLE001 - its own `download`, when it comes, tries again
                log.debug("the begun download of %s failed (%s); it is tried again when asked for", begun, error)
        if self._pending is None:
            self._send(proc, _Pending(self.source, filename), limited)
        return self._answer(proc)

    def _send(self, proc: subprocess.Popen[str], pending: _Pending, limited: bool = False) -> None:
        request = json.dumps({"source": asdict(self.source), "filename": pending.filename, "limited": limited})
        self._pending = pending
        try:
            assert proc.stdin is not None
            proc.stdin.write(request + "\n")
            proc.stdin.flush()
        except (OSError, ValueError):  # the child is gone: `_answer` says so
            pass

    def _answer(self, proc: subprocess.Popen[str]) -> Fetched:
        pending = self._pending
        assert pending is not None
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()
        except (OSError, ValueError):  # the child is gone, or `close` closed its pipes
            line = ""
        finally:
            self._pending = None
        if not line:
            raise PrequantError(
                f"the download of {pending.filename} of {self.source.repo_id} stopped: its process ended "
                f"(exit status {proc.poll()}); run the command again"
            )
        reply = json.loads(line)
        if "path" in reply:
            return pending.fetched(Path(reply["path"]))
        raise pickle.loads(base64.b64decode(reply["error"]))

    def _answered(self) -> Fetched | None:
        """The begun download's file if its answer is already here (without waiting), else None."""
        proc = self._proc
        if self._pending is None or proc is None or proc.stdout is None:
            return None
        try:
            if not select.select([proc.stdout], [], [], 0)[0]:
                return None
            return self._answer(proc)
        except Exception:  # noqa: BLE001 - the download's own error (or a child gone): nothing finished
            return None

    def close(self) -> None:
        """End the child: at once if it is downloading (the conversion is over), else once it sees EOF."""
        with self._lock:
            proc, self._proc, self._closed = self._proc, None, True
            if self._limit_fd is not None:
                os.close(self._limit_fd)  # the child's own copy stays valid until it exits
                self._limit_fd = None
        self.ended.set()
        if proc is None:
            return
        if self._busy:  # a failed or interrupted conversion: its download is not wanted any more
            proc.kill()
        try:
            assert proc.stdin is not None
            proc.stdin.close()
        except OSError:
            pass
        try:
            proc.wait(timeout=_EXIT_WAIT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def _child(self) -> subprocess.Popen[str] | None:
        with self._lock:
            if self._closed:  # the conversion is over: nothing more to fetch, and no child left behind
                raise PrequantError(f"downloads from {self.source.repo_id} were stopped (the conversion ended)")
            if self._proc is None and not self._in_process:
                paths = (_PACKAGE_ROOT, os.environ.get("PYTHONPATH"))  # the child imports this same prequant
                env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
                try:
                    limit = [] if self._limit_fd is None else ["--limit-fd", str(self._limit_fd)]
                    self._proc = subprocess.Popen(
                        [sys.executable, "-m", "prequant.hub.fetcher", *limit], stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE, text=True, env=env, pass_fds=() if not limit else (self._limit_fd,),
                    )  # fmt: skip
                except OSError as error:  # e.g. an embedded interpreter without a python executable
                    log.debug("downloading in this process: no child (%s)", error)
                    self._in_process = True
            return self._proc


_early: list[Fetcher] = []  # begun before the conversion knew its source (`keep_early`), until adopted
_expected: list[threading.Event] = []  # set once an early start has kept its Fetcher, or given up
_EARLY_WAIT_S = 30.0  # the longest `adopt` waits for one: a resolve and an index download, seconds at most


def expect_early() -> threading.Event:
    """Announce an early start (a Fetcher `keep_early` will hold): `adopt` waits for it; set the event when done."""
    done = threading.Event()
    _expected.append(done)
    return done


def keep_early(fetcher: Fetcher) -> None:
    """Hold `fetcher`, whose first download is begun, for the conversion of its commit to `adopt`. Its child dies
    with the thread that started it (PR_SET_PDEATHSIG, `_die_with_parent`), so that thread must wait for
    `fetcher.ended` before it ends."""
    _early.append(fetcher)


def adopt(source: client.HubCommit) -> Fetcher:
    """The Fetcher for `source`: one begun early for the same commit, else a new one. An early Fetcher of another
    commit (the branch moved in between) is closed (`close_early`)."""
    wait_early()
    for early in _early:
        if (early.source.repo_id, early.source.sha) == (source.repo_id, source.sha):
            _early.remove(early)
            close_early()
            return early
    close_early()
    return Fetcher(source)


def wait_early() -> None:
    """Wait for the early starts announced (`expect_early`), as `adopt` does, without taking any."""
    while _expected:
        _expected.pop().wait(_EARLY_WAIT_S)


def close_early() -> list[tuple[client.HubCommit, Fetched]]:
    """Close every early Fetcher nobody adopted (the conversion stopped before its downloads, or resolved another
    commit); return the files their begun downloads had finished, with their commit, for the caller to keep or
    evict. A download still running is cut, and its partial file removed (`client.remove_stale_partials`)."""
    finished: list[tuple[client.HubCommit, Fetched]] = []
    while _early:
        early = _early.pop()
        done = early._answered()
        if done is not None:
            finished.append((early.source, done))
        cut = early._busy
        early.close()
        if cut:
            client.remove_stale_partials(early.source.repo_id)
    return finished


def _limit_memfd() -> int | None:
    """An 8-byte memfd holding "no limit", or None where memfds do not exist."""
    if not hasattr(os, "memfd_create"):
        return None
    try:
        fd = os.memfd_create("prequant-download-limit")  # close-on-exec: only the fetcher's child gets it (pass_fds)
    except OSError:
        return None
    os.pwrite(fd, _LIMIT.pack(_UNLIMITED), 0)
    return fd


def _read(fd: int) -> int:
    """The limit in the memfd `fd`."""
    return _LIMIT.unpack(os.pread(fd, _LIMIT.size, 0))[0]


def _die_with_parent() -> None:
    """Linux: be killed when the thread that started this process ends (the parent's download thread, or the
    whole parent if it is killed); elsewhere nothing: the closed stdin ends this process after its download."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the parent died before the call above
        os._exit(1)


def _serve(limit_fd: int | None) -> None:
    """The child: one download per request line, one reply line each, until stdin closes; `limit_fd`: the
    parent's memfd holding a limited download's limit."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent()
    replies, sys.stdout = sys.stdout, sys.stderr  # whatever a library prints goes to stderr, not into the replies
    for line in sys.stdin:
        request = json.loads(line)
        try:
            limit = (lambda: _read(limit_fd)) if request.get("limited") and limit_fd is not None else None
            path = client.download(client.HubCommit(**request["source"]), request["filename"], large=True,
                                   limit=limit)
            reply = {"path": str(path)}
        except Exception as error:  # noqa: BLE001 - every failure goes back to the parent, which raises it
            try:
                payload = pickle.dumps(error)
                pickle.loads(payload)  # some exceptions pickle but cannot be rebuilt (their __init__ wants more)
            except Exception:  # noqa: BLE001 - an error that does not cross: its type and text
                payload = pickle.dumps(RuntimeError(f"{type(error).__name__}: {error}"))
            reply = {"error": base64.b64encode(payload).decode()}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


if __name__ == "__main__":
    _serve(int(sys.argv[2]) if sys.argv[1:2] == ["--limit-fd"] else None)
