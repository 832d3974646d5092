"""`prequant upload` and convert --push-to-hub: publish an output to the Hub, gated on verify."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ..checkpoint import manifest
from ..checkpoint.manifest import MANIFEST
from ..errors import PrequantError
from ..hub import upload as hub_upload
from .check import VerificationFailed
from .run import verify


def upload(
    output_dir: str | Path,
    repo_id: str,
    *,
    revision: str | None = None,
    private: bool = False,
    commit_message: str | None = None,
    token: str | None = None,
    progress: bool = True,
    publisher: hub_upload.Publisher | None = None,
) -> dict:
    """Verify OUTPUT_DIR, then upload it to the Hub in one commit (`hub.upload`); return what was sent.

    Refuses (VerificationFailed, nothing sent) when verification finds a problem, and when OUTPUT_DIR
    holds files that are not part of the conversion (they would be published too). Into an existing repo, the
    checkpoint files the new one does not have (an earlier conversion's shards and index) are deleted in the
    same commit; `private` on an existing public repo is refused. `publisher`: one already open, that sent the
    shards while they were written (convert --push-to-hub)."""
    out = Path(output_dir)
    report = verify(out, progress=progress)
    if not report.ok:
        raise VerificationFailed(report, f"refusing to upload {out}, it does not verify")
    if report.extra_files:
        extra = report.extra_files
        more = f" and {len(extra) - 1} more" if len(extra) > 1 else ""
        raise PrequantError(
            f"refusing to upload {out}: {extra[0]}{more} is not part of the conversion (not in prequant.json) and "
            "would be published too; move it out of OUTPUT_DIR"
        )
    files = report.listed_files + [MANIFEST]  # as verify just read them
    listed = manifest.load(out)["files"]
    digests = {name: listed.get(name, {}).get("sha256") for name in files}  # verified: not hashed again
    done = hub_upload.upload(out, repo_id, revision=revision, private=private, commit_message=commit_message,
                             token=token, files=digests, stale=_replaced_by(files), publisher=publisher,
                             progress=progress)
    return {
        "repo_id": repo_id,
        "revision": revision,
        "private": done.private,  # the repo's visibility, as the Hub has it
        "commit_url": done.commit_url,
        "files": sorted(files),
        "deleted": done.deleted,
        "bytes": sum((out / f).stat().st_size for f in files),
        "verified": True,
    }


def _replaced_by(files: list[str]) -> Callable[[list[str]], list[str]]:
    """Which files of the repo the upload replaces: the checkpoint files a loader would take (weights and index at
    the top level, e.g. an earlier conversion's shards) that the new one does not have. Everything else in the repo
    (its own notes, other folders) stays."""
    new = set(files)
    loadable = (".safetensors", ".index.json")
    return lambda remote: [f for f in remote if f not in new and "/" not in f and (
        f.endswith(loadable) or (f.startswith("pytorch_model") and f.endswith(".bin")))]


def push_converted(output_dir: Path, repo_id: str, *, progress: bool = True,
                   publisher: hub_upload.Publisher | None = None) -> str:
    """convert --push-to-hub: verify and upload a finished output in one commit; return the commit URL. A failure
    says the conversion itself is complete, and that the same command (or `prequant upload`) sends what is
    missing."""
    try:
        return upload(output_dir, repo_id, progress=progress, publisher=publisher)["commit_url"]
    except PrequantError as e:
        raise e.noted(
            f" (the conversion itself is complete in {output_dir}; once fixed, run the same command again, or "
            f"`prequant upload {output_dir} {repo_id}`: what the Hub holds already is not sent again)"
        ) from e


def publisher(repo_id: str, *, private: bool = False, progress: bool = True) -> hub_upload.Publisher:
    """convert --push-to-hub's upload, opened before the conversion: the repo is created (private with `private`;
    an existing public one is then refused) first, and each shard is sent once it is sealed."""
    return hub_upload.Publisher(repo_id, private=private, progress=progress).open()
