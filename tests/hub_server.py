"""A real, local Hugging Face Hub for tests: `huggingface_hub` talks HTTP to it as it would to huggingface.co.

The server speaks the endpoints that huggingface_hub 2.4 calls (read from its source: hf_api.py,
file_download.py, _commit_api.py, lfs.py) and keeps a tiny git-like history in memory:

- repos live on disk under ``<root>/<org>/<name>/`` (the head of ``main``, kept in sync after every
  commit); file contents are stored content-addressed under ``<root>/.hub-blobs/<sha256>``;
- every commit has a deterministic 40-hex sha (sha1 of the parent and the sorted file list), so the
  same files always give the same sha;
- files matching usual weight suffixes or of 10 MiB and more are "LFS" files: their resolve answers a
  302 to a CDN-like URL on another origin (``localhost`` instead of ``127.0.0.1``) carrying
  ``X-Linked-Etag``/``X-Linked-Size``, exactly like the Hub, so the client drops the token there.

Endpoints: ``GET /api/whoami-v2``; ``GET /api/models/{repo}`` and ``.../revision/{rev}`` (``?blobs=true``,
``expand``); ``GET .../tree/{rev}[/{path}]`` (``recursive``, Link-header pagination); ``POST
.../paths-info/{rev}``; ``GET .../refs``; ``HEAD|GET /{repo}/resolve/{rev}/{path}`` (Range, 302 for
LFS); ``HEAD|GET /cdn-lfs/{sha256}``; ``POST /api/repos/create``; ``POST .../branch/{branch}``;
``POST .../preupload/{rev}``; ``POST .../commit/{rev}`` (ndjson); ``POST /{repo}.git/info/lfs/objects/batch``
+ ``PUT /lfs-upload/{oid}`` + ``POST /lfs-verify/{repo}`` (basic LFS transfer); ``POST /api/validate-yaml``.
Xet is not implemented: the fixture sets ``HF_HUB_DISABLE_XET=1`` so large uploads use the LFS protocol
(or set ``server.upload_mode = "regular"`` to have every file committed inline, which Xet clients accept).

Faults for tests: ``server.requests`` / ``server.request_log`` record every request,
``server.fail(repo_id, filename, ...)`` makes serving a file answer an HTTP error, close the connection
mid-body, reset it (a TCP RST) mid-body, or hold it (``ranged=True``/``False``: only ranged requests, e.g. header
reads, or only whole-file ones), ``server.fail_request(method, path, ...)`` makes any request (a repo lookup, a
file's metadata, a ranged read, a commit) answer an HTTP error, have its connection reset before any answer, or
answer an error after doing what it asked ("applied": a commit that lands although its answer is a 5xx),
``server.stall(route, skip=N)`` holds the requests to a route after the first N,
``server.require_token = True`` (or ``add_repo(..., private=True)``) answers 401 without
``Authorization: Bearer <server.token>``.

Use the ``hub_server`` fixture (function-scoped): it starts a server in ``tmp_path``, points
``HF_ENDPOINT``/``HF_HOME`` (env, inherited by subprocesses) and huggingface_hub's import-time constants
at it, and stops it afterwards.
"""

from __future__ import annotations

import array
import base64
import fcntl
import fnmatch
import hashlib
import json
import os
import re
import shutil
import socket
import struct
import termios
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar, Literal
from urllib.parse import parse_qs, unquote, urlencode, urlsplit

import pytest

TOKEN = "hf_prequantTESTtoken0123456789abcdefXYZ"
USER = "prequant-tester"
DATE = "2024-01-01T00:00:00.000Z"
LFS_THRESHOLD = 10 * 1024 * 1024
LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".onnx", ".npy", ".npz")
GITATTRIBUTES = b"".join(f"*{suffix} filter=lfs diff=lfs merge=lfs -text\n".encode() for suffix in LFS_SUFFIXES)
_CHUNK = 256 * 1024


# ----------------------------------------------------------------------------------------------- storage


@dataclass(frozen=True)
class Blob:
    """One stored file content; ``lfs`` says whether the Hub would keep it in LFS."""

    sha256: str
    size: int
    git_sha1: str
    lfs: bool

    @property
    def pointer(self) -> bytes:
        return f"version https://git-lfs.github.com/spec/v1\noid sha256:{self.sha256}\nsize {self.size}\n".encode()

    @property
    def etag(self) -> str:
        """What the Hub sends as (X-Linked-)ETag: sha256 for LFS files, the git blob sha1 otherwise."""
        return self.sha256 if self.lfs else self.git_sha1

    @property
    def blob_id(self) -> str:
        """The git object id: of the pointer file for LFS files."""
        return _git_sha1(self.pointer) if self.lfs else self.git_sha1


@dataclass(frozen=True)
class Commit:
    sha: str
    parent: str | None
    message: str
    files: Mapping[str, Blob]


@dataclass
class Repo:
    repo_id: str
    private: bool = False
    gated: bool = False
    refs: dict[str, str] = field(default_factory=dict)  # branch or tag -> commit sha
    commits: dict[str, Commit] = field(default_factory=dict)
    linked: bool = False  # its files are hard links to the caller's (add_repo(link=True))


@dataclass
class Fault:
    """An injected failure when serving ``filename`` of ``repo_id``.

    kind "status": answer ``status`` instead of the file; kind "drop": send the headers of the full
    answer, then the body up to absolute file offset ``after_bytes``, then close the connection; kind "reset": the
    same, but once those bytes have reached the client the connection is reset (a TCP RST, as a load balancer
    or a peer that died sends: the client's read fails, it sees no end of file); kind "hold":
    send the body up to ``after_bytes``, set ``arrived``, and send the rest only once ``release`` is set (or
    after 60 s): a download caught mid-body, for as long as the test needs.
    ``times``: how many matching requests it hits (None: all of them). ``ranged``: True hits only requests
    with a Range header (e.g. header reads), False only requests without one (e.g. whole-file downloads),
    "resume" only those whose Range has no end (``bytes=N-``: a download resumed mid-file, never a header read),
    None all. ``min_start``: only requests for bytes from this offset on (a resumed download, not a header read).
    """

    repo_id: str
    filename: str
    kind: Literal["status", "drop", "reset", "hold"] = "status"
    status: int = 500
    after_bytes: int = 0
    times: int | None = None
    methods: tuple[str, ...] = ("GET",)
    ranged: bool | Literal["resume"] | None = None
    min_start: int = 0
    arrived: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)


@dataclass
class RequestFault:
    """An injected failure of any request whose method is ``method`` and whose path (percent-decoded, without the
    query) matches the glob ``path``: kind "reset" resets the connection (a TCP RST) once the request is read,
    before any answer; kind "status" answers ``status``; kind "applied" does what the request asks (e.g. a commit
    lands) and then answers ``status``, as a Hub whose answer is lost behind a failing proxy. ``times``: how many
    matching requests it hits (None: all); ``ranged``: as `Fault`'s."""

    method: str
    path: str
    kind: Literal["status", "reset", "applied"] = "reset"
    status: int = 503
    times: int | None = 1
    ranged: bool | None = None


class _Reset(Exception):
    """The handler reset its connection: nothing more is read or sent on it."""


@dataclass
class Stall:
    """Requests held by `HubServer.stall` until ``release`` is set; the first ``skip`` pass unheld."""

    arrived: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)
    skip: int = 0


@dataclass
class RequestRecord:
    method: str
    path: str  # URL path, percent-decoded, without the query
    query: dict[str, list[str]]
    headers: dict[str, str]  # lower-cased names
    status: int | None = None
    at: float = field(default_factory=time.time)  # when it arrived (wall clock, comparable with file times)

    @property
    def authorized(self) -> bool:
        return "authorization" in self.headers

    @property
    def to_the_end(self) -> bool:
        """Whether it asks for a file's bytes up to its end: the whole file, or a download resumed mid-file
        (``bytes=N-``), not a bounded read such as a header's."""
        return open_ended(self.headers.get("range"))


def open_ended(range_header: str | None) -> bool:
    """No Range, or one without an end (``bytes=N-``)."""
    return range_header is None or range_header.strip().endswith("-")


class HubError(Exception):
    """An HTTP error answer, with the X-Error-Code the client maps to its exception types."""

    def __init__(
        self, status: int, code: str | None, message: str, headers: dict[str, str] | None = None, **body: Any
    ) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.headers, self.body = status, code, message, headers or {}, body


def _git_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _is_lfs_path(path: str, size: int) -> bool:
    return size >= LFS_THRESHOLD or path.endswith(LFS_SUFFIXES)


def _commit_sha(parent: str | None, files: Mapping[str, Blob], message: str) -> str:
    listing = "".join(f"{path}\0{blob.sha256}\n" for path, blob in sorted(files.items()))
    return hashlib.sha1(f"parent {parent}\nmessage {message}\n{listing}".encode()).hexdigest()


# ------------------------------------------------------------------------------------------------ server


class HubServer:
    """A local Hub on 127.0.0.1; see the module docstring."""

    def __init__(self, root: Path, *, token: str = TOKEN, cdn_host: str = "localhost") -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.blob_dir = self.root / ".hub-blobs"
        self.blob_dir.mkdir(exist_ok=True)
        self.token = token
        self.require_token = False  # every repo behaves as private
        self.upload_mode: Literal["auto", "regular"] = "auto"  # "regular": preupload never answers "lfs"
        self.lfs_redirect = _resolves_to_loopback(cdn_host)  # 302 LFS files to the "CDN" origin
        self.tree_page_size = 1000
        self.request_log: list[RequestRecord] = []
        self.served: list[tuple[str, str]] = []  # (repo_id, filename) of every file body sent
        self._faults: list[Fault] = []
        self._made: list[Fault] = []  # every fault, also those used up
        self._request_faults: list[RequestFault] = []
        self._stalls: dict[str, Stall] = {}
        self._repos: dict[str, Repo] = {}
        self._lock = threading.RLock()
        self._cdn_host = cdn_host
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle

    def start(self) -> HubServer:
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self._httpd.daemon_threads = True
        self._httpd.hub = self  # type: ignore[attr-defined]
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, name="hub-server", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        for stall in self._stalls.values():
            stall.release.set()
        for fault in self._made:  # a held body, too, goes on (and ends) with the server
            fault.release.set()
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None

    def __enter__(self) -> HubServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def port(self) -> int:
        assert self._httpd is not None, "server not started"
        return self._httpd.server_address[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def cdn_url(self) -> str:
        return f"http://{self._cdn_host}:{self.port}"

    @property
    def env(self) -> dict[str, str]:
        """Environment variables pointing a huggingface_hub process at this server."""
        return {"HF_ENDPOINT": self.url, "HF_HUB_DISABLE_XET": "1"}

    # -- repos

    def add_repo(
        self,
        repo_id: str,
        files: Mapping[str, bytes | str | Path],
        revision: str = "main",
        *,
        private: bool | None = None,
        gated: bool | None = None,
        message: str = "Add files",
        link: bool = False,
        sha256s: Mapping[str, str] | None = None,
    ) -> str:
        """Set the complete file set of ``revision`` (a branch, created from ``main`` if new); returns its sha.

        ``link=True`` (for benchmarks serving many GB): files given as paths are hard-linked into the store,
        never read into memory, their sha256 taken from ``sha256s`` where given (else streamed), and the
        repo's folder is laid out with links too; the files must then not be modified in place."""
        with self._lock:
            repo = self._repos.get(repo_id) or self._create(repo_id, with_gitattributes=False)
            if private is not None:
                repo.private = private
            if gated is not None:
                repo.gated = gated
            blobs = {
                path: self.store_file(content, path=path, sha256=(sha256s or {}).get(path))
                if link and isinstance(content, Path)
                else self.store(_read(content), lfs=None, path=path)
                for path, content in files.items()
            }
            repo.linked = repo.linked or link
            parent = repo.refs.get(revision) or repo.refs.get("main")
            return self._commit(repo, revision, parent, blobs, message)

    def add_branch(self, repo_id: str, branch: str, revision: str = "main") -> str:
        """Point ``branch`` (or a tag) at ``revision``'s commit; returns the sha."""
        with self._lock:
            repo = self._get(repo_id)
            repo.refs[branch] = self._resolve_rev(repo, revision)
            return repo.refs[branch]

    def head(self, repo_id: str, revision: str = "main") -> str:
        with self._lock:
            return self._resolve_rev(self._get(repo_id), revision)

    def files(self, repo_id: str, revision: str = "main") -> dict[str, bytes]:
        """All files of ``repo_id`` at ``revision``, as bytes."""
        with self._lock:
            repo = self._get(repo_id)
            commit = repo.commits[self._resolve_rev(repo, revision)]
        return {path: self.blob_path(blob).read_bytes() for path, blob in commit.files.items()}

    def commits(self, repo_id: str, revision: str = "main") -> list[Commit]:
        """The history of ``revision``, newest first."""
        with self._lock:
            repo = self._get(repo_id)
            sha: str | None = self._resolve_rev(repo, revision)
            history = []
            while sha is not None:
                history.append(repo.commits[sha])
                sha = repo.commits[sha].parent
            return history

    def has_repo(self, repo_id: str) -> bool:
        with self._lock:
            return self._find(repo_id) is not None

    # -- faults and logs

    def fail(self, repo_id: str, filename: str, kind: Literal["status", "drop", "reset", "hold"] = "status",
             **options: Any) -> Fault:
        """Inject a failure when serving a file (see `Fault`); returns it."""
        fault = Fault(repo_id, filename, kind, **options)
        with self._lock:
            self._faults.append(fault)
            self._made.append(fault)
        return fault

    def fail_request(self, method: str, path: str, kind: Literal["status", "reset", "applied"] = "reset",
                     **options: Any) -> RequestFault:
        """Inject a failure of any request matching ``method`` and the path glob ``path`` (see `RequestFault`)."""
        fault = RequestFault(method, path, kind, **options)
        with self._lock:
            self._request_faults.append(fault)
        return fault

    def stall(self, route: str, *, skip: int = 0) -> Stall:
        """Hold every request to ``route`` (a handler's name, e.g. "preupload" or "commit") after the first
        ``skip`` until the returned stall is released (or 60 s pass); its ``arrived`` event is set when the first
        held one comes in."""
        stall = Stall(skip=skip)
        with self._lock:
            self._stalls[route] = stall
        return stall

    def clear_faults(self) -> None:
        with self._lock:
            self._faults.clear()
            self._request_faults.clear()

    @property
    def requests(self) -> list[tuple[str, str]]:
        """(method, path) of every request so far."""
        with self._lock:
            return [(record.method, record.path) for record in self.request_log]

    def clear_log(self) -> None:
        with self._lock:
            self.request_log.clear()
            self.served.clear()

    def served_files(self, repo_id: str | None = None) -> list[str]:
        """Filenames whose content was sent (GET through /resolve or the CDN), in order."""
        with self._lock:
            return [name for repo, name in self.served if repo_id is None or repo == repo_id]

    # -- internals shared with the handler

    def store(self, data: bytes, *, lfs: bool | None, path: str) -> Blob:
        sha256 = hashlib.sha256(data).hexdigest()
        target = self.blob_dir / sha256
        if not target.exists():
            tmp = target.with_suffix(f".{threading.get_ident()}.tmp")
            tmp.write_bytes(data)
            tmp.replace(target)
        is_lfs = _is_lfs_path(path, len(data)) if lfs is None else lfs
        return Blob(sha256=sha256, size=len(data), git_sha1=_git_sha1(data), lfs=is_lfs)

    def store_file(self, source: Path, *, path: str, sha256: str | None = None) -> Blob:
        """Store a file by hard link (a copy across file systems), hashing it in pieces if no sha256 is given."""
        size = source.stat().st_size
        if sha256 is None:
            digest = hashlib.sha256()
            with open(source, "rb") as f:
                while chunk := f.read(1 << 24):
                    digest.update(chunk)
            sha256 = digest.hexdigest()
        target = self.blob_dir / sha256
        if not target.exists():
            _link_or_copy(source, target)
        is_lfs = _is_lfs_path(path, size)
        # The git blob sha1 only names non-LFS files (LFS ones are named by their pointer), which are small.
        git_sha1 = "" if is_lfs else _git_sha1(source.read_bytes())
        return Blob(sha256=sha256, size=size, git_sha1=git_sha1, lfs=is_lfs)

    def blob_path(self, blob: Blob) -> Path:
        return self.blob_dir / blob.sha256

    def stored_lfs_object(self, oid: str) -> Path | None:
        path = self.blob_dir / oid
        return path if re.fullmatch(r"[0-9a-f]{64}", oid) and path.is_file() else None

    def _create(self, repo_id: str, *, private: bool = False, with_gitattributes: bool = True) -> Repo:
        repo = Repo(repo_id=repo_id, private=private)
        self._repos[repo_id] = repo
        if with_gitattributes:  # the Hub's initial commit of a new repo
            blob = self.store(GITATTRIBUTES, lfs=False, path=".gitattributes")
            self._commit(repo, "main", None, {".gitattributes": blob}, "initial commit")
        return repo

    def _commit(self, repo: Repo, branch: str, parent: str | None, files: Mapping[str, Blob], message: str) -> str:
        sha = _commit_sha(parent, files, message)
        repo.commits[sha] = Commit(sha=sha, parent=parent, message=message, files=dict(files))
        repo.refs[branch] = sha
        if branch == "main":
            self._materialize(repo)
        return sha

    def _materialize(self, repo: Repo) -> None:
        """Mirror the head of main into <root>/<org>/<name>/ so tests can look at files on disk."""
        target = self.root / repo.repo_id
        if target.exists():
            shutil.rmtree(target)
        target.mkdir(parents=True)
        for path, blob in repo.commits[repo.refs["main"]].files.items():
            (target / path).parent.mkdir(parents=True, exist_ok=True)
            if repo.linked:
                _link_or_copy(self.blob_path(blob), target / path)
            else:
                shutil.copyfile(self.blob_path(blob), target / path)

    def _find(self, repo_id: str) -> Repo | None:
        """A known repo, or one laid out on disk by a test under <root>/<org>/<name>/ (imported as main)."""
        repo = self._repos.get(repo_id)
        folder = self.root / repo_id
        if repo is None and repo_id.count("/") == 1 and not repo_id.startswith(".") and folder.is_dir():
            files = {p.relative_to(folder).as_posix(): p for p in sorted(folder.rglob("*")) if p.is_file()}
            self.add_repo(repo_id, files)
            repo = self._repos[repo_id]
        return repo

    def _get(self, repo_id: str) -> Repo:
        repo = self._find(repo_id)
        if repo is None:
            raise KeyError(f"no repo {repo_id} on the test hub")
        return repo

    def _resolve_rev(self, repo: Repo, revision: str) -> str:
        if revision in repo.refs:
            return repo.refs[revision]
        if revision in repo.commits:
            return revision
        raise HubError(404, "RevisionNotFound", f"Invalid rev id: {revision}")

    def _take_fault(self, repo_id: str, filename: str, method: str, range_header: str | None,
                    start: int = 0) -> Fault | None:  # fmt: skip
        ranged = bool(range_header)
        resume = ranged and open_ended(range_header)
        with self._lock:
            for fault in self._faults:
                if (
                    fault.repo_id == repo_id
                    and fault.filename == filename
                    and method in fault.methods
                    and (fault.ranged in (None, ranged) or (fault.ranged == "resume" and resume))
                    and start >= fault.min_start
                ):
                    if fault.times is not None:
                        fault.times -= 1
                        if fault.times <= 0:
                            self._faults.remove(fault)
                    return fault
        return None


    def _take_request_fault(self, method: str, path: str, range_header: str | None) -> RequestFault | None:
        with self._lock:
            for fault in self._request_faults:
                if (fault.method == method and fnmatch.fnmatchcase(path, fault.path)
                        and fault.ranged in (None, bool(range_header))):
                    if fault.times is not None:
                        fault.times -= 1
                        if fault.times <= 0:
                            self._request_faults.remove(fault)
                    return fault
        return None


def _link_or_copy(source: Path, target: Path) -> None:
    tmp = target.with_suffix(f".{threading.get_ident()}.tmp")
    try:
        os.link(source, tmp)
    except OSError:
        shutil.copyfile(source, tmp)
    tmp.replace(target)


def _read(content: bytes | str | Path) -> bytes:
    if isinstance(content, Path):
        return content.read_bytes()
    return content.encode() if isinstance(content, str) else bytes(content)


def _resolves_to_loopback(host: str) -> bool:
    try:
        return all(info[4][0] == "127.0.0.1" for info in socket.getaddrinfo(host, None, socket.AF_INET))
    except OSError:
        return False


# ----------------------------------------------------------------------------------------------- handler

_REPO = r"(?P<repo>[^/]+/[^/]+)"
_REV = r"(?P<rev>[^/]+)"


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the client's connection pool expects
    server_version = "prequant-test-hub/1"
    routes: ClassVar[list[tuple[str, re.Pattern[str], str]]] = []  # filled below

    @property
    def hub(self) -> HubServer:
        return self.server.hub  # type: ignore[attr-defined]

    def log_message(self, format: str, *args: Any) -> None:  # quiet: tests read request_log instead
        pass

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_HEAD(self) -> None:
        self._dispatch("HEAD")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def handle(self) -> None:
        try:
            super().handle()
        except _Reset:
            pass

    def _reset(self) -> None:
        """Reset the connection (a TCP RST), once what was sent has reached the client (so that it reads those
        bytes, then the reset)."""
        self.wfile.flush()
        unsent = array.array("i", [0])
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            fcntl.ioctl(self.connection.fileno(), termios.TIOCOUTQ, unsent)  # bytes the client has not acknowledged
            if unsent[0] == 0:
                break
            time.sleep(0.005)
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.rfile.close()  # the socket's last reference but the connection itself: closing it sends the RST
        self.wfile.close()
        self.connection.close()
        raise _Reset

    # -- plumbing

    def _dispatch(self, method: str) -> None:
        split = urlsplit(self.path)
        self.query = parse_qs(split.query)
        self.body = self._read_body()
        headers = {key.lower(): value for key, value in self.headers.items()}
        self.record = RequestRecord(method, unquote(split.path), self.query, headers)
        with self.hub._lock:
            self.hub.request_log.append(self.record)
        fault = self.hub._take_request_fault(method, self.record.path, self.headers.get("Range"))
        if fault is not None and fault.kind == "reset":
            self._reset()
        if fault is not None and fault.kind == "status":
            self._send_error(HubError(fault.status, None, f"injected failure of {method} {self.record.path}"))
            return
        self._swallow = fault is not None  # "applied": the handler's answer is replaced by the error
        for route_method, pattern, name in self.routes:
            match = pattern.fullmatch(split.path)
            if match and (route_method == method or (route_method == "GET" and method == "HEAD")):
                with self.hub._lock:
                    stall = self.hub._stalls.get(name)
                    held = stall is not None and stall.skip <= 0
                    if stall is not None:
                        stall.skip -= 1
                if held:
                    stall.arrived.set()
                    stall.release.wait(60)
                try:
                    getattr(self, name)(**{k: unquote(v) for k, v in match.groupdict().items() if v is not None})
                    if self._swallow:
                        self._swallow = False
                        message = f"injected failure after {method} {self.record.path}"
                        self._send_error(HubError(fault.status if fault is not None else 500, None, message))
                except HubError as error:
                    self._swallow = False
                    self._send_error(error)
                except (BrokenPipeError, ConnectionResetError):
                    self.close_connection = True
                return
        self._swallow = False
        self._send_error(HubError(404, None, f"no route for {method} {split.path}"))

    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _send(self, status: int, body: bytes = b"", headers: Mapping[str, str] | None = None) -> None:
        if getattr(self, "_swallow", False):
            return
        self.record.status = status
        self.send_response(status)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, data: Any, status: int = 200, headers: Mapping[str, str] | None = None) -> None:
        self._send(status, json.dumps(data).encode(), {"Content-Type": "application/json", **(headers or {})})

    def _send_error(self, error: HubError) -> None:
        headers = {"X-Error-Message": error.message, **error.headers}
        if error.code:
            headers["X-Error-Code"] = error.code
        self._json({"error": error.message, **error.body}, error.status, headers)

    def _json_body(self) -> Any:
        try:
            return json.loads(self.body or b"{}")
        except json.JSONDecodeError as e:
            raise HubError(400, None, f"invalid JSON body: {e}") from e

    # -- auth

    def _token(self) -> str | None:
        """The bearer token sent, or None; a wrong one is rejected as the Hub does."""
        auth = self.headers.get("Authorization")
        if not auth:
            return None
        token = auth.removeprefix("Bearer ").strip()
        if token != self.hub.token:
            raise HubError(401, None, "Invalid credentials in Authorization header")
        return token

    def _repo(self, repo_id: str, *, write: bool = False) -> Repo:
        """The repo, enforcing read (private) and write access; unknown repos answer like the Hub."""
        token = self._token()
        with self.hub._lock:
            repo = self.hub._find(repo_id)
        if repo is None or ((repo.private or self.hub.require_token) and token is None):
            # The Hub answers 401 to anonymous callers so as not to reveal whether a private repo exists.
            status = 401 if token is None else 404
            raise HubError(status, "RepoNotFound", "Repository not found")
        if write and token is None:
            raise HubError(401, None, "Invalid username or password.")
        return repo

    def _require_login(self) -> str:
        token = self._token()
        if token is None:
            raise HubError(401, None, "Invalid username or password.")
        return token

    # -- read endpoints

    def whoami(self) -> None:
        self._require_login()
        self._json(
            {
                "type": "user",
                "id": "0" * 24,
                "name": USER,
                "fullname": "Prequant Tester",
                "email": None,
                "emailVerified": False,
                "isPro": False,
                "orgs": [],
                "auth": {"type": "access_token", "accessToken": {"displayName": "tests", "role": "write"}},
            }
        )

    def model_info(self, repo: str, rev: str = "main") -> None:
        repo_obj = self._repo(repo)
        with self.hub._lock:
            sha = self.hub._resolve_rev(repo_obj, rev)
            commit = repo_obj.commits[sha]
        with_blobs = self.query.get("blobs", ["false"])[0].lower() in ("true", "1")
        siblings = [self._sibling(path, blob, with_blobs) for path, blob in sorted(commit.files.items())]
        info: dict[str, Any] = {
            "_id": hashlib.sha1(repo.encode()).hexdigest()[:24],
            "id": repo,
            "modelId": repo,
            "author": repo.split("/")[0],
            "sha": sha,
            "lastModified": DATE,
            "createdAt": DATE,
            "private": repo_obj.private or self.hub.require_token,
            "gated": "auto" if repo_obj.gated else False,
            "disabled": False,
            "downloads": 0,
            "likes": 0,
            "tags": [],
            "siblings": siblings,
            "usedStorage": sum(blob.size for blob in commit.files.values()),
        }
        if "expand" in self.query:
            wanted = set(self.query["expand"])
            info = {key: value for key, value in info.items() if key in wanted or key in ("_id", "id")}
        self._json(info)

    @staticmethod
    def _sibling(path: str, blob: Blob, with_blobs: bool) -> dict[str, Any]:
        sibling: dict[str, Any] = {"rfilename": path}
        if with_blobs:
            sibling.update(size=blob.size, blobId=blob.blob_id)
            if blob.lfs:
                sibling["lfs"] = {"size": blob.size, "sha256": blob.sha256, "pointerSize": len(blob.pointer)}
        return sibling

    def tree(self, repo: str, rev: str, path: str = "") -> None:
        repo_obj = self._repo(repo)
        with self.hub._lock:
            commit = repo_obj.commits[self.hub._resolve_rev(repo_obj, rev)]
        recursive = self.query.get("recursive", ["false"])[0].lower() in ("true", "1")
        entries = _tree_entries(commit.files, path.strip("/"), recursive)
        if entries is None:
            raise HubError(404, "EntryNotFound", f"{path} does not exist on {rev}")
        start = int(self.query.get("cursor", ["0"])[0])
        page = entries[start : start + self.hub.tree_page_size]
        headers = {}
        if start + self.hub.tree_page_size < len(entries):
            query = {key: values[0] for key, values in self.query.items()}
            query["cursor"] = str(start + self.hub.tree_page_size)
            headers["Link"] = f'<{self.hub.url}{urlsplit(self.path).path}?{urlencode(query)}>; rel="next"'
        self._json(page, headers=headers)

    def paths_info(self, repo: str, rev: str) -> None:
        repo_obj = self._repo(repo)
        with self.hub._lock:
            commit = repo_obj.commits[self.hub._resolve_rev(repo_obj, rev)]
        paths = parse_qs(self.body.decode()).get("paths", [])  # form-encoded, one "paths" per path
        entries = _tree_entries(commit.files, "", recursive=True) or []
        wanted = {p.strip("/") for p in paths}
        self._json([entry for entry in entries if entry["path"] in wanted])

    def refs(self, repo: str) -> None:
        repo_obj = self._repo(repo)
        with self.hub._lock:
            branches = [
                {"name": name, "ref": f"refs/heads/{name}", "targetCommit": sha} for name, sha in repo_obj.refs.items()
            ]
        self._json({"branches": branches, "tags": [], "converts": []})

    def resolve(self, repo: str, rev: str, path: str) -> None:
        repo_obj = self._repo(repo)
        with self.hub._lock:
            sha = self.hub._resolve_rev(repo_obj, rev)
            blob = repo_obj.commits[sha].files.get(path)
        if blob is None:
            raise HubError(404, "EntryNotFound", f"{path} does not exist on {rev}", {"X-Repo-Commit": sha})
        if repo_obj.gated and self._token() is None:
            message = f"Access to model {repo} is restricted. You must have access to it and be authenticated."
            raise HubError(401, "GatedRepo", message)
        headers = {"X-Repo-Commit": sha, "ETag": f'"{blob.etag}"', "Accept-Ranges": "bytes"}
        if blob.lfs:
            headers.update({"X-Linked-Etag": f'"{blob.sha256}"', "X-Linked-Size": str(blob.size)})
            if self.hub.lfs_redirect:
                # Like the Hub: metadata on the redirect itself, content on another origin (a signed CDN URL).
                query = urlencode({"repo": repo, "file": path})
                headers["Location"] = f"{self.hub.cdn_url}/cdn-lfs/{blob.sha256}?{query}"
                self._send(302, b"", headers)
                return
        self._send_blob(repo, path, blob, headers)

    def cdn(self, oid: str) -> None:
        stored = self.hub.stored_lfs_object(oid)
        if stored is None:
            raise HubError(404, None, "NoSuchKey")
        repo, filename = self.query.get("repo", [""])[0], self.query.get("file", [""])[0]
        blob = Blob(sha256=oid, size=stored.stat().st_size, git_sha1="", lfs=True)
        self._send_blob(repo, filename, blob, {"ETag": f'"{oid}"', "Accept-Ranges": "bytes"})

    def _send_blob(self, repo: str, filename: str, blob: Blob, headers: dict[str, str]) -> None:
        start, end, status = 0, blob.size, 200
        range_header = self.headers.get("Range")
        if range_header and self.command == "GET":
            start, end = _parse_range(range_header, blob.size)
            status = 206
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{blob.size}"
        fault = self.hub._take_fault(repo, filename, self.command, range_header, start=start)
        if fault is not None and fault.kind == "status":
            raise HubError(fault.status, None, f"injected failure serving {filename}")
        self.record.status = status
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(end - start))
        self.send_header("Content-Type", "application/octet-stream")
        self.end_headers()
        if self.command == "HEAD":
            return
        with self.hub._lock:
            self.hub.served.append((repo, filename))
        stop = end if fault is None else max(start, min(end, fault.after_bytes))
        with open(self.hub.blob_path(blob), "rb") as f:
            f.seek(start)
            self._copy(f, stop - start)
            if fault is not None and fault.kind == "hold":
                self.wfile.flush()
                fault.arrived.set()
                fault.release.wait(60)
                self._copy(f, end - stop)
                return
        if fault is not None and fault.kind == "reset":
            self._reset()
        if fault is not None:  # "drop": cut the connection mid-body
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)

    def _copy(self, f: Any, length: int) -> None:
        """Send the next `length` bytes of file `f`."""
        while length > 0:
            chunk = f.read(min(_CHUNK, length))
            self.wfile.write(chunk)
            length -= len(chunk)

    # -- write endpoints

    def validate_yaml(self) -> None:
        self._json({"errors": [], "warnings": []})

    def create_repo(self) -> None:
        self._require_login()
        payload = self._json_body()
        if payload.get("type", "model") != "model":
            raise HubError(400, None, "the test hub only hosts model repos")
        repo_id = f"{payload.get('organization') or USER}/{payload['name']}"
        private = payload.get("visibility") == "private" or bool(payload.get("private"))
        with self.hub._lock:
            if self.hub._find(repo_id) is not None:
                raise HubError(409, None, "You already created this model repo", url=f"{self.hub.url}/{repo_id}")
            self.hub._create(repo_id, private=private)
        self._json({"url": f"{self.hub.url}/{repo_id}", "name": repo_id, "id": repo_id})

    def create_branch(self, repo: str, rev: str) -> None:
        repo_obj = self._repo(repo, write=True)
        start = self._json_body().get("startingPoint") or "main"
        with self.hub._lock:
            if rev in repo_obj.refs:
                raise HubError(409, None, f"Reference refs/heads/{rev} already exists")
            repo_obj.refs[rev] = self.hub._resolve_rev(repo_obj, start)
        self._json({})

    def preupload(self, repo: str, rev: str) -> None:
        repo_obj = self._repo(repo, write=True)
        with self.hub._lock:
            current = repo_obj.commits[self.hub._resolve_rev(repo_obj, rev)].files
        answers = []
        for entry in self._json_body().get("files", []):
            lfs = self.hub.upload_mode == "auto" and _is_lfs_path(entry["path"], entry["size"])
            existing = current.get(entry["path"])
            # The client skips unchanged files by comparing this oid with its own (sha256 for LFS, git sha1 else).
            oid = None if existing is None else (existing.sha256 if lfs else existing.git_sha1)
            answers.append(
                {"path": entry["path"], "uploadMode": "lfs" if lfs else "regular", "shouldIgnore": False, "oid": oid}
            )
        self._json({"files": answers, "commitOid": None})

    def commit(self, repo: str, rev: str) -> None:
        repo_obj = self._repo(repo, write=True)
        if self.query.get("create_pr"):
            raise HubError(400, None, "the test hub does not support pull requests")
        lines = [json.loads(line) for line in self.body.splitlines() if line.strip()]
        header = next((line["value"] for line in lines if line["key"] == "header"), {})
        with self.hub._lock:
            parent = self.hub._resolve_rev(repo_obj, rev)
            if rev not in repo_obj.refs:
                raise HubError(400, None, f"cannot commit to {rev}: not a branch")
            if header.get("parentCommit") not in (None, parent):
                raise HubError(412, None, "A commit has happened since. Please refresh and try again.")
            files = dict(repo_obj.commits[parent].files)
            for line in lines:
                self._apply(files, line["key"], line["value"])
            sha = self.hub._commit(repo_obj, rev, parent, files, header.get("summary", ""))
        self._json(
            {
                "success": True,
                "commitOid": sha,
                "commitUrl": f"{self.hub.url}/{repo}/commit/{sha}",
                "hookOutput": "",
                "pullRequestUrl": None,
            }
        )

    def _apply(self, files: dict[str, Blob], key: str, value: dict[str, Any]) -> None:
        if key == "file":
            content = base64.b64decode(value["content"]) if value.get("encoding") == "base64" else value["content"]
            files[value["path"]] = self.hub.store(_read(content), lfs=None, path=value["path"])
        elif key == "lfsFile":
            stored = self.hub.stored_lfs_object(value["oid"])
            if stored is None:
                raise HubError(422, None, f"LFS object {value['oid']} for {value['path']} was never uploaded")
            files[value["path"]] = self.hub.store(stored.read_bytes(), lfs=True, path=value["path"])
        elif key == "deletedFile":
            if files.pop(value["path"], None) is None:
                raise HubError(404, "EntryNotFound", f"A file with this name doesn't exist: {value['path']}")
        elif key == "deletedFolder":
            prefix = value["path"].rstrip("/") + "/"
            for path in [p for p in files if p.startswith(prefix)]:
                del files[path]
        elif key != "header":
            raise HubError(400, None, f"unsupported commit operation {key}")

    def lfs_batch(self, repo: str) -> None:
        self._repo(repo, write=True)
        payload = self._json_body()
        if payload.get("operation") != "upload":
            raise HubError(400, None, "the test hub only supports LFS uploads")
        objects = []
        for obj in payload.get("objects", []):
            answer: dict[str, Any] = {"oid": obj["oid"], "size": obj["size"], "authenticated": True}
            if self.hub.stored_lfs_object(obj["oid"]) is None:  # already there: no actions, client skips it
                answer["actions"] = {
                    "upload": {"href": f"{self.hub.url}/lfs-upload/{obj['oid']}?size={obj['size']}", "header": {}},
                    "verify": {"href": f"{self.hub.url}/lfs-verify/{repo}", "header": {}},
                }
            objects.append(answer)
        self._send(
            200,
            json.dumps({"transfer": "basic", "objects": objects}).encode(),
            {"Content-Type": "application/vnd.git-lfs+json"},
        )

    def lfs_upload(self, oid: str) -> None:
        if hashlib.sha256(self.body).hexdigest() != oid:
            raise HubError(400, None, "uploaded content does not match its sha256")
        self.hub.store(self.body, lfs=True, path="")
        self._send(200)

    def lfs_verify(self, repo: str) -> None:
        payload = self._json_body()
        stored = self.hub.stored_lfs_object(payload.get("oid", ""))
        if stored is None or stored.stat().st_size != payload.get("size"):
            raise HubError(404, None, "LFS object not found or of the wrong size")
        self._json({})

    def xet_token(self, repo: str, rev: str | None = None) -> None:
        raise HubError(
            501,
            None,
            "the prequant test hub does not implement Xet: set HF_HUB_DISABLE_XET=1 or server.upload_mode = 'regular'",
        )


_Handler.routes = [
    (method, re.compile(pattern), name)
    for method, pattern, name in [
        ("GET", r"/api/whoami-v2", "whoami"),
        ("GET", rf"/api/models/{_REPO}", "model_info"),
        ("GET", rf"/api/models/{_REPO}/revision/{_REV}", "model_info"),
        ("GET", rf"/api/models/{_REPO}/tree/{_REV}(?:/(?P<path>.*))?", "tree"),
        ("POST", rf"/api/models/{_REPO}/paths-info/{_REV}", "paths_info"),
        ("GET", rf"/api/models/{_REPO}/refs", "refs"),
        ("GET", rf"/api/models/{_REPO}/xet-(?:read|write)-token(?:/{_REV})?", "xet_token"),
        ("GET", rf"/{_REPO}/resolve/{_REV}/(?P<path>.+)", "resolve"),
        ("GET", r"/cdn-lfs/(?P<oid>[0-9a-f]{64})", "cdn"),
        ("POST", r"/api/validate-yaml", "validate_yaml"),
        ("POST", r"/api/repos/create", "create_repo"),
        ("POST", rf"/api/models/{_REPO}/branch/{_REV}", "create_branch"),
        ("POST", rf"/api/models/{_REPO}/preupload/{_REV}", "preupload"),
        ("POST", rf"/api/models/{_REPO}/commit/{_REV}", "commit"),
        ("POST", rf"/{_REPO}\.git/info/lfs/objects/batch", "lfs_batch"),
        ("PUT", r"/lfs-upload/(?P<oid>[0-9a-f]{64})", "lfs_upload"),
        ("POST", rf"/lfs-verify/{_REPO}", "lfs_verify"),
    ]
]


def _parse_range(header: str, size: int) -> tuple[int, int]:
    """'bytes=a-b' / 'bytes=a-' / 'bytes=-n' -> [start, end) within the file."""
    match = re.fullmatch(r"bytes=(\d*)-(\d*)", header.strip())
    if not match or match.group(1) == match.group(2) == "":
        raise HubError(416, None, f"unsupported Range {header!r}")
    first, last = match.groups()
    if first == "":
        return max(0, size - int(last)), size
    start = int(first)
    end = min(size, int(last) + 1) if last else size
    if start >= size > 0:
        raise HubError(416, None, f"Range {header!r} outside a {size}-byte file")
    return start, end


def _tree_entries(files: Mapping[str, Blob], folder: str, recursive: bool) -> list[dict[str, Any]] | None:
    """The /tree listing of ``folder`` (files and directories), or None if it does not exist."""
    prefix = f"{folder}/" if folder else ""
    below = sorted(path for path in files if path.startswith(prefix))
    if folder and not below:
        return None
    dirs: set[str] = set()
    entries: list[dict[str, Any]] = []
    for path in below:
        parts = path[len(prefix) :].split("/")
        for depth in range(1, len(parts) if recursive else min(2, len(parts))):
            dirs.add(prefix + "/".join(parts[:depth]))
        if recursive or len(parts) == 1:
            blob = files[path]
            entry: dict[str, Any] = {"type": "file", "oid": blob.blob_id, "size": blob.size, "path": path}
            if blob.lfs:
                entry["lfs"] = {"oid": blob.sha256, "size": blob.size, "pointerSize": len(blob.pointer)}
            entries.append(entry)
    folders = [
        {"type": "directory", "oid": hashlib.sha1(d.encode()).hexdigest(), "size": 0, "path": d} for d in sorted(dirs)
    ]
    return folders + entries


# ------------------------------------------------------------------------------------------------ fixture

# Environment that must not leak from the developer's shell into tests.
_CLEARED_ENV = (
    "HF_TOKEN",
    "HUGGING_FACE_HUB_TOKEN",
    "HF_TOKEN_PATH",
    "HF_HUB_OFFLINE",
    "TRANSFORMERS_OFFLINE",
    "HF_HUB_CACHE",
    "HUGGINGFACE_HUB_CACHE",
    "HF_ASSETS_CACHE",
    "HUGGINGFACE_ASSETS_CACHE",
    "HF_XET_CACHE",
    "HUGGINGFACE_CO_STAGING",
    "XDG_CACHE_HOME",
    "HF_HUB_ETAG_TIMEOUT",
    "HF_HUB_DOWNLOAD_TIMEOUT",
)


def point_huggingface_hub_at(server: HubServer, hf_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Point env (for subprocesses) and huggingface_hub's import-time constants (in-process) at ``server``."""
    for name in _CLEARED_ENV:
        monkeypatch.delenv(name, raising=False)
    env = {
        **server.env,
        "HF_HOME": str(hf_home),
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HUB_DISABLE_UPDATE_CHECK": "1",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "HF_HUB_DISABLE_SYMLINKS_WARNING": "1",
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)

    # huggingface_hub copies these from the environment once, at import time.
    from huggingface_hub import constants, hf_api

    cache = str(hf_home / "hub")
    for name, value in {
        "ENDPOINT": server.url,
        "HUGGINGFACE_CO_URL_TEMPLATE": server.url + "/{repo_id}/resolve/{revision}/{filename}",
        "HF_HOME": str(hf_home),
        "HF_HUB_CACHE": cache,
        "HUGGINGFACE_HUB_CACHE": cache,
        "HF_ASSETS_CACHE": str(hf_home / "assets"),
        "HF_TOKEN_PATH": str(hf_home / "token"),
        "HF_STORED_TOKENS_PATH": str(hf_home / "stored_tokens"),
        "HF_HUB_OFFLINE": False,
        "HF_HUB_DISABLE_XET": True,
        "HF_HUB_DISABLE_TELEMETRY": True,
        "HF_HUB_ETAG_TIMEOUT": constants.DEFAULT_ETAG_TIMEOUT,
        "HF_HUB_DOWNLOAD_TIMEOUT": constants.DEFAULT_DOWNLOAD_TIMEOUT,
    }.items():
        if hasattr(constants, name):
            monkeypatch.setattr(constants, name, value)
    monkeypatch.setattr(hf_api.api, "endpoint", server.url)  # the instance behind huggingface_hub.model_info & co


@pytest.fixture
def hub_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[HubServer]:
    """A fresh local Hub; HF_ENDPOINT, HF_HOME (a tmp dir) and huggingface_hub point at it for this test."""
    from huggingface_hub.utils import close_session

    server = HubServer(tmp_path / "hub-server").start()
    point_huggingface_hub_at(server, tmp_path / "hf-home", monkeypatch)
    # prequant retries a failing download for 2 minutes by default; 3 s (waits of 1 and 2 s) keeps a test of a
    # failure that lasts short. A test of riding out an outage sets its own.
    monkeypatch.setenv("PREQUANT_HUB_RETRY_S", "3")
    try:
        yield server
    finally:
        server.stop()
        close_session()  # drop pooled keep-alive connections to this server


__all__ = [
    "TOKEN",
    "USER",
    "Blob",
    "Commit",
    "Fault",
    "HubServer",
    "RequestFault",
    "RequestRecord",
    "Stall",
    "hub_server",
    "point_huggingface_hub_at",
]
