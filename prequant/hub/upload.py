"""Upload a folder to a Hub repo in one commit (the write side of `client`, which resolves and downloads).

A new repo is created (private if asked), a branch named in the spec or the call is created from main, the files
that `stale` names on that branch are deleted in the same commit; an existing public repo is never made to look
private by a flag. Every failure becomes one `PrequantError` line that names the repo and says what to do
(`failures.explain`); tokens never appear in messages.
"""

from __future__ import annotations

import glob
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import HfApi, constants

from ..errors import PrequantError, UsageError
from . import cache
from .client import API_TIMEOUT_S, api, parse_repo_spec
from .failures import explain


@dataclass(frozen=True)
class Uploaded:
    """What `upload` did: the commit, the repo's visibility, the remote files it deleted."""

    commit_url: str
    private: bool
    deleted: list[str]


def upload(
    folder: Path,
    repo_id: str,
    *,
    revision: str | None = None,
    private: bool = False,
    commit_message: str | None = None,
    token: str | None = None,
    stale: Callable[[list[str]], list[str]] | None = None,
) -> Uploaded:
    """Create ``repo_id`` if needed and upload ``folder`` to it in one commit.

    ``repo_id`` may carry the branch as ``org/name@branch`` instead of ``revision``; a new branch is created
    from main. ``stale(remote files)`` names the branch's files to delete in the same commit. ``private`` makes
    a new repo private; an existing public repo is refused (nothing sent): its visibility is its owner's setting.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise UsageError(f"cannot upload {folder}: not a directory")
    repo_id, spec_revision = parse_repo_spec(repo_id)
    if spec_revision is not None and revision not in (None, spec_revision):
        raise UsageError(f"two revisions given for the upload to {repo_id}: {spec_revision} and {revision}")
    revision = revision or spec_revision
    if revision is not None and cache.SHA_RE.fullmatch(revision):
        raise UsageError(f"cannot upload to commit {revision} of {repo_id}: pass a branch name")
    action = f"upload {folder} to {repo_id}" + (f"@{revision}" if revision else "")
    if cache.offline():
        raise PrequantError(f"cannot {action}: HF_HUB_OFFLINE is set; unset it to upload")
    hub = api(token)
    visibility = _visibility(hub, repo_id)
    if visibility is False and private:
        raise PrequantError(
            f"refusing to upload to {repo_id}: it exists and is public, and --private does not change an existing "
            f"repo's visibility; make it private first (its settings on the Hub, or huggingface_hub's "
            f"update_repo_settings({repo_id!r}, private=True)), or upload without --private"
        )
    try:
        if visibility is None:
            hub.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        if revision not in (None, constants.DEFAULT_REVISION):
            hub.create_branch(repo_id, branch=revision, exist_ok=True)  # type: ignore[arg-type]
        deleted = sorted(stale(hub.list_repo_files(repo_id, revision=revision))) if stale is not None else []
        info = hub.upload_folder(
            folder_path=folder,
            repo_id=repo_id,
            revision=revision,
            commit_message=commit_message or "Upload bitsandbytes 4-bit checkpoint made with prequant",
            delete_patterns=[glob.escape(name) for name in deleted] or None,  # exact names, not patterns
        )
    except Exception as error:
        message = explain(error, action, repo_id, revision, token, endpoint=cache.endpoint(), writing=True)
        raise PrequantError(message) from error
    return Uploaded(info.commit_url, private if visibility is None else visibility, deleted)


def _visibility(hub: HfApi, repo_id: str) -> bool | None:
    """Whether the repo is private; None when it does not exist (or cannot be seen, which create_repo then says)."""
    try:
        return bool(hub.model_info(repo_id, timeout=API_TIMEOUT_S).private)
    except Exception:  # noqa: BLE001 - missing, unreachable, no access: create_repo says which
        return None


__all__ = ["Uploaded", "upload"]
