"""Publish a folder to a Hub repo in one commit (the write side of `client`, which resolves and downloads).

A `Publisher` decides the repo's visibility on a definite answer (a passing failure is retried, an unknown one
refuses), creates the repo (private if asked) and the branch, sends files ahead of the commit while the caller
still writes others (`send`: a sealed shard, on a thread), then commits everything at once (`commit`), so the
revision never shows a partial checkpoint. Every call is retried on passing failures for `settings.hub_retry_s()`;
a commit whose answer is lost is looked for on the branch before it is sent again, so it lands once. Objects the
Hub already holds are not sent again (huggingface_hub's preupload and LFS batch say which), so a rerun after an
interruption sends only what is missing. Failures become one `PrequantError` line (`failures.explain`).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Self, TypeVar

from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi, constants
from huggingface_hub.errors import RepositoryNotFoundError

from ..errors import PrequantError, UsageError, flag
from ..util.progress import Progress
from . import cache
from .client import API_TIMEOUT_S, api, parse_repo_spec, retrying
from .failures import short

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class Uploaded:
    """What `upload` did: the commit, the repo's visibility, the remote files it deleted."""

    commit_url: str
    private: bool
    deleted: list[str]


class Publisher:
    """One upload to ``repo_id`` (``org/name[@branch]``): `open`, `send` files early, `commit` once, `close`."""

    def __init__(self, repo_id: str, *, revision: str | None = None, private: bool = False,
                 token: str | None = None, progress: bool = True) -> None:  # fmt: skip
        repo_id, spec_revision = parse_repo_spec(repo_id)
        if spec_revision is not None and revision not in (None, spec_revision):
            raise UsageError(f"two revisions given for the upload to {repo_id}: {spec_revision} and {revision}")
        self.repo_id, self.revision = repo_id, revision or spec_revision
        if self.revision is not None and cache.SHA_RE.fullmatch(self.revision):
            raise UsageError(f"cannot upload to commit {self.revision} of {repo_id}: pass a branch name")
        self.label = repo_id + (f"@{self.revision}" if self.revision else "")
        if cache.offline():
            raise PrequantError(f"cannot upload to {self.label}: HF_HUB_OFFLINE is set; unset it to upload")
        self.asked_private, self.token, self.progress = private, token, progress
        self.private = private
        self._hub: HfApi = api(token)
        self._sent: dict[str, CommitOperationAdd] = {}  # files sent ahead of the commit, by name in the repo
        self._queue: queue.Queue[tuple[str, tuple[Path, ...], Callable[[], str]] | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    # -- the repo

    def open(self) -> Publisher:
        """Decide the repo's visibility, create it (and the branch) if needed; refuse --private into a public repo."""
        visibility = self._visibility()
        self._refuse_public(visibility)
        if visibility is None:
            self._call(lambda: self._hub.create_repo(self.repo_id, private=self.asked_private, exist_ok=True,
                                                     repo_type="model"), f"create {self.repo_id}")  # fmt: skip
            visibility = self._visibility()  # what the Hub made (another client may have been first)
            if visibility is None:
                raise PrequantError(f"cannot upload to {self.label}: the Hub created it but does not show it; "
                                    "check the token's access and try again")
            self._refuse_public(visibility)
        self.private = visibility
        if self.revision not in (None, constants.DEFAULT_REVISION):
            self._call(lambda: self._hub.create_branch(self.repo_id, branch=self.revision, exist_ok=True),
                       f"create branch {self.revision} of {self.repo_id}")  # fmt: skip
        return self

    def _visibility(self) -> bool | None:
        """Whether the repo is private; None only when the Hub answers that it does not exist. Passing failures are
        retried; any other answer (refused, no access, an outage that outlasts the retries) refuses the upload."""

        def look() -> bool | None:
            try:
                return bool(self._hub.model_info(self.repo_id, timeout=API_TIMEOUT_S).private)
            except RepositoryNotFoundError:
                return None

        return self._call(look, f"look up {self.repo_id} (its visibility decides the upload)")

    def _refuse_public(self, private: bool | None) -> None:
        if private is False and self.asked_private:
            raise PrequantError(
                f"refusing to upload to {self.repo_id}: it exists and is public, and {flag('private')} does not "
                f"change an existing repo's visibility; make it private first (its settings on the Hub, or "
                f"huggingface_hub's update_repo_settings({self.repo_id!r}, private=True)), or upload without "
                f"{flag('private')}"
            )

    def _call(self, attempt: Callable[[], T], action: str) -> T:
        return retrying(attempt, action, self.repo_id, self.revision, self.token, writing=True)

    def _head(self) -> str:
        """The branch's head commit."""
        info = self._call(lambda: self._hub.model_info(self.repo_id, revision=self.revision, timeout=API_TIMEOUT_S),
                          f"read the head of {self.label}")  # fmt: skip
        return info.sha  # type: ignore[attr-defined]

    # -- files sent ahead of the commit

    def send(self, name: str, places: tuple[Path, ...], sha256: Callable[[], str]) -> None:
        """Upload file ``name`` now, on a thread, without committing it: from the first of ``places`` that holds
        it (a shard is renamed into staging once sealed, then moved to OUTPUT_DIR), once ``sha256()`` gives its
        digest. A failure here is only logged: `commit` sends whatever is missing."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._send_loop, name="prequant-upload", daemon=True)
            self._thread.start()
        self._queue.put((name, places, sha256))

    def _send_loop(self) -> None:
        while (item := self._queue.get()) is not None and not self._stop.is_set():
            name, places, sha256 = item
            try:
                digest = sha256()
                while not (found := [p for p in places if p.is_file()]) and not self._stop.wait(0.01):
                    pass  # its rename into place follows its hash
                if not found:
                    return
                op = _addition(name, found[0], digest)
                self._call(lambda op=op: self._hub.preupload_lfs_files(self.repo_id, additions=[op],
                                                                       revision=self.revision, free_memory=False),
                           f"upload {name} to {self.label}")  # fmt: skip
                self._sent[name] = op
            except Exception as error:  # noqa: BLE001 - the commit sends it again, and says what fails then
                log.warning("early upload of %s failed (%s); it is sent with the commit", name, short(error, self.token))

    def _drain(self) -> None:
        """Wait for the files sent ahead to be uploaded."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None

    def close(self) -> None:
        """Stop sending (an interrupted conversion): the upload in flight ends with the process."""
        self._stop.set()
        if self._thread is not None:
            self._queue.put(None)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:  # fmt: skip
        self.close()

    # -- the commit

    def commit(self, folder: Path, files: dict[str, str | None], *, message: str | None = None,
               stale: Callable[[list[str]], list[str]] | None = None) -> Uploaded:  # fmt: skip
        """Commit ``files`` of ``folder`` (name -> sha256 where known) and delete what ``stale(remote files)``
        names, in one commit; files the Hub holds already are not sent again."""
        self._drain()
        action = f"upload {folder} to {self.label}"
        deleted = sorted(stale(self._call(lambda: self._hub.list_repo_files(self.repo_id, revision=self.revision),
                                          f"list the files of {self.label}"))) if stale is not None else []  # fmt: skip
        additions = []
        for name, digest in sorted(files.items()):
            sent = self._sent.get(name)
            if sent is not None:
                sent.path_or_fileobj = str(folder / name)  # where it is now (a regular file's content goes inline)
            additions.append(sent or _addition(name, folder / name, digest))
        pending = [op for op in additions if op.path_in_repo not in self._sent]
        with Progress(sum(op.upload_info.size for op in additions), enabled=self.progress, label="uploading") as bar:
            bar.advance(sum(op.upload_info.size for op in additions if op.path_in_repo in self._sent))  # sent already
            for op in pending:  # one at a time: progress per file; what the Hub holds already is skipped
                self._call(lambda op=op: self._hub.preupload_lfs_files(self.repo_id, additions=[op],
                                                                       revision=self.revision, free_memory=False),
                           f"{action} ({op.path_in_repo})")  # fmt: skip
                bar.advance(op.upload_info.size)
        operations = [*additions, *(CommitOperationDelete(name) for name in deleted)]
        commit_url = self._commit_once(operations, message or "Upload bitsandbytes 4-bit checkpoint made with prequant",
                                       action)
        return Uploaded(commit_url, self.private, deleted)

    def _commit_once(self, operations: list, message: str, action: str) -> str:
        """Create the commit on the branch's current head, retried; after a failure, the branch is read first:
        a commit that landed although its answer was lost is not sent again."""
        parent = self._head()
        tried = False

        def attempt() -> str:
            nonlocal tried
            if tried:
                head = self._head()
                if head != parent and self._landed(head, operations):
                    return f"{cache.endpoint()}/{self.repo_id}/commit/{head}"
            tried = True
            info = self._hub.create_commit(self.repo_id, operations, commit_message=message, revision=self.revision,
                                           parent_commit=parent)
            return info.commit_url

        return self._call(attempt, action)

    def _landed(self, head: str, operations: list) -> bool:
        """Whether commit ``head`` holds every addition as sent and none of the deletions."""
        info = self._hub.model_info(self.repo_id, revision=head, files_metadata=True, timeout=API_TIMEOUT_S)
        remote = {s.rfilename: (s.lfs.sha256 if s.lfs else s.blob_id) for s in info.siblings or []}
        for op in operations:
            if isinstance(op, CommitOperationAdd):
                # As the commit named it: LFS files by their sha256, regular ones by their git blob id.
                oid = op.upload_info.sha256.hex() if op._upload_mode == "lfs" else _git_oid(op)
                if remote.get(op.path_in_repo) != oid:
                    return False
            elif op.path_in_repo in remote:
                return False
        return True


def _addition(name: str, path: Path, sha256: str | None) -> CommitOperationAdd:
    """The file as a commit operation, its digest given where known (a shard's, hashed as it was written)."""
    op = CommitOperationAdd(path_in_repo=name, path_or_fileobj=str(path))
    if sha256:
        op.upload_info.sha256 = bytes.fromhex(sha256)
    return op


def _git_oid(op: CommitOperationAdd) -> str:
    from huggingface_hub.utils.sha import git_hash

    with op.as_file() as f:
        return git_hash(f.read())


def upload(
    folder: Path,
    repo_id: str,
    *,
    revision: str | None = None,
    private: bool = False,
    commit_message: str | None = None,
    token: str | None = None,
    files: Iterable[str] | dict[str, str | None] | None = None,
    stale: Callable[[list[str]], list[str]] | None = None,
    publisher: Publisher | None = None,
    progress: bool = True,
) -> Uploaded:
    """Create ``repo_id`` if needed and upload ``folder`` (``files`` of it, default all) to it in one commit.

    ``repo_id`` may carry the branch as ``org/name@branch`` instead of ``revision``; a new branch is created
    from main. ``stale(remote files)`` names the branch's files to delete in the same commit. ``private`` makes
    a new repo private; an existing public repo is refused (nothing sent): its visibility is its owner's setting.
    ``publisher``: one already open (that sent some files ahead).
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise UsageError(f"cannot upload {folder}: not a directory")
    if files is None:
        files = [p.relative_to(folder).as_posix() for p in sorted(folder.rglob("*")) if p.is_file()]
    digests = files if isinstance(files, dict) else dict.fromkeys(files)
    own = publisher is None
    publisher = publisher or Publisher(repo_id, revision=revision, private=private, token=token, progress=progress)
    try:
        if own:
            publisher.open()
        return publisher.commit(folder, digests, message=commit_message, stale=stale)
    finally:
        if own:
            publisher.close()


__all__ = ["Publisher", "Uploaded", "upload"]
