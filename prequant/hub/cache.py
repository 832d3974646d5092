"""The Hugging Face cache and settings as prequant uses them, read from the environment at each call.

Where the cache is (HF_HOME / HF_HUB_CACHE), which endpoint (HF_ENDPOINT), whether offline mode is on
(HF_HUB_OFFLINE), and what lets an offline run resolve a repo: the revision -> sha refs and the commit's file
listing, recorded once a file of that commit is downloaded (huggingface_hub writes no ref for downloads
pinned to a sha). And what prequant does to the cache besides downloading: take a file out (`evict`) and remove partial
downloads nobody is writing (`remove_stale_partials`).
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

from filelock import FileLock, Timeout  # huggingface_hub's own lock library: the same locks as its downloads
from huggingface_hub import constants

from .. import settings
from ..errors import PrequantError
from ..util import failpoints

try:  # Per-commit file listing cache (huggingface_hub >= 2.x; snapshot_download writes it too)
    from huggingface_hub._tree_cache import TreeCacheEntry, read_tree_cache, write_tree_cache
except ImportError:  # pragma: no cover - older huggingface_hub: offline resolve lists the snapshot folder
    TreeCacheEntry = read_tree_cache = write_tree_cache = None  # type: ignore[assignment,misc]

log = logging.getLogger("prequant.hub")
SHA_RE = re.compile(r"[0-9a-f]{40}")
_LISTINGS: dict[tuple[str, str], dict] = {}  # (repo_id, sha) -> file listing, from resolve() until a download
# huggingface_hub's partial download: blobs/<etag>.<8 hex>.incomplete, one name per download.
_PARTIAL_RE = re.compile(r"[0-9a-f]+\.[0-9a-f]{8}\.incomplete")


def endpoint() -> str:
    """The Hub's URL: HF_ENDPOINT, else huggingface_hub's default."""
    return (settings.hf_endpoint() or constants.ENDPOINT).rstrip("/")


def cache_dir() -> Path:
    """The hub cache, resolved like huggingface_hub does at import, but from the current environment."""
    return Path(settings.hf_cache_dir())


def offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) as huggingface_hub reads it, but from the current environment."""
    value = settings.hf_offline()
    return constants.HF_HUB_OFFLINE if value is None else value


def storage_folder(repo_id: str) -> Path:
    """The cache folder of a model repo (refs, blobs, snapshots)."""
    return cache_dir() / f"models--{repo_id.replace('/', '--')}"


def blobs_folder(repo_id: str) -> Path:
    """Where the repo's files are kept, each under its etag (the snapshots link to them)."""
    return storage_folder(repo_id) / "blobs"


def snapshot_path(repo_id: str, sha: str, filename: str) -> Path:
    """Where a file of commit `sha` is found in the cache (a link to its blob), whether it is there yet or not."""
    return storage_folder(repo_id) / "snapshots" / sha / filename


def lock_path(repo_id: str, etag: str) -> Path:
    """The lock huggingface_hub holds while it downloads blob `etag` of the repo (and prequant's transfer too)."""
    return cache_dir() / ".locks" / storage_folder(repo_id).name / f"{etag}.lock"


def keep_listing(repo_id: str, sha: str, siblings: list) -> None:
    """Hold the commit's full listing until a download creates its snapshot folder (see `remember`)."""
    if TreeCacheEntry is not None and all(s.blob_id and s.size is not None for s in siblings):
        _LISTINGS[(repo_id, sha)] = {
            s.rfilename: TreeCacheEntry(
                size=s.size,
                blob_id=s.blob_id,
                lfs_sha256=s.lfs.sha256 if s.lfs else None,
                lfs_size=s.lfs.size if s.lfs else None,
            )
            for s in siblings
        }


def remember(repo_id: str, revision: str | None, sha: str) -> None:
    """Record revision -> sha and the full file listing in the cache, so that an offline run can resolve.

    Downloads are pinned to the sha, so huggingface_hub writes no ref itself. Done only once a file is
    downloaded: a cache entry without a snapshot folder would look corrupted to `hf cache`.
    """
    storage = storage_folder(repo_id)
    ref = revision or constants.DEFAULT_REVISION
    try:
        if not SHA_RE.fullmatch(ref) and read_ref(storage / "refs" / ref) != sha:
            (storage / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
            (storage / "refs" / ref).write_text(sha)
        listing = _LISTINGS.pop((repo_id, sha), None)
        if listing is not None and read_tree_cache(str(storage), sha) is None:
            write_tree_cache(str(storage), sha, listing)
    except OSError as error:  # a cache we cannot annotate only costs offline resolves
        log.debug("could not record %s@%s in the cache: %s", repo_id, ref, error)


def not_cached_offline(action: str) -> PrequantError:
    """The error for a file that offline mode cannot download (`action`: what failed, naming the file)."""
    return PrequantError(f"cannot {action}: HF_HUB_OFFLINE is set and the file {_not_in_cache()}")


def _not_in_cache() -> str:
    return (f"is not in the Hugging Face cache at {cache_dir()}; unset HF_HUB_OFFLINE to download it, or pass "
            "the model's local directory")


def resolve_offline(repo_id: str, revision: str | None, label: str) -> tuple[str, dict[str, int]]:
    """The commit sha and file sizes of ``repo_id`` at ``revision``, from the cache alone (HF_HUB_OFFLINE)."""
    storage = storage_folder(repo_id)
    ref = revision or constants.DEFAULT_REVISION
    sha = ref if SHA_RE.fullmatch(ref) else read_ref(storage / "refs" / ref)
    snapshot = storage / "snapshots" / (sha or "-")
    if sha is None or not snapshot.is_dir():
        raise PrequantError(f"cannot resolve {label} offline: it {_not_in_cache()}")
    return sha, cached_files(storage, sha, snapshot)


def read_ref(path: Path) -> str | None:
    """The sha a cached ref points to, or None when it is missing or not a sha."""
    try:
        sha = path.read_text().strip()
    except OSError:
        return None
    return sha if SHA_RE.fullmatch(sha) else None


def cached_files(storage: Path, sha: str, snapshot: Path) -> dict[str, int]:
    """The commit's full listing if cached, else what the snapshot folder holds (possibly partial)."""
    if read_tree_cache is not None:
        entries = read_tree_cache(str(storage), sha)
        if entries is not None:
            return {path: entry.size for path, entry in entries.items()}
    log.warning("no cached file listing for %s; using the files present in %s", sha, snapshot)
    return {
        path.relative_to(snapshot).as_posix(): path.stat().st_size
        for path in sorted(snapshot.rglob("*"))
        if path.is_file()
    }


def blob_of(repo_id: str, pointer: Path) -> Path | None:
    """The blob a snapshot link points to, if it is this repo's (a link out of the repo's cache is never followed)."""
    if not pointer.is_symlink():
        return None
    blob = Path(os.path.normpath(pointer.parent / os.readlink(pointer)))
    return blob if blob.parent == blobs_folder(repo_id) else None


def evict(repo_id: str, sha: str, filename: str) -> None:
    """Delete a downloaded file (its blob, then its snapshot link) from the cache; does nothing if absent.

    The blob goes first: a process killed in between leaves a dangling link, which the next download of the file
    replaces and a resumed conversion removes, never a blob that no link names (a shard's worth of disk that no run
    would find again)."""
    pointer = snapshot_path(repo_id, sha, filename)
    if pointer.is_symlink():
        if (blob := blob_of(repo_id, pointer)) is not None:
            blob.unlink(missing_ok=True)
        failpoints.hit("blob-evicted")
        pointer.unlink(missing_ok=True)
    elif pointer.is_file():  # no-symlink caches keep the file itself in the snapshot
        pointer.unlink()


def remove_stale_partials(repo_id: str) -> list[str]:
    """Delete the repo's partial downloads that no download is writing; return their names.

    huggingface_hub downloads each file into ``blobs/<etag>.<8 hex>.incomplete``, a name of its own for each
    download, while it holds ``.locks/<repo folder>/<etag>.lock``, and never reuses it: a process killed mid-download
    leaves it behind. A partial file whose lock this process can take is one no download is writing (the lock is
    the kernel's flock, released when its holder dies), so it goes; one whose lock is held stays.
    ``<etag>.incomplete``, the partial file a download resumes (prequant's transfer, and huggingface_hub before
    2.4), is kept for the next download of that file."""
    try:
        partials = sorted(p for p in blobs_folder(repo_id).iterdir() if _PARTIAL_RE.fullmatch(p.name))
    except OSError:
        return []
    removed = []
    for partial in partials:
        lock = FileLock(str(lock_path(repo_id, partial.name.split(".", 1)[0])), timeout=0)
        try:
            with lock:
                partial.unlink(missing_ok=True)
        except (Timeout, OSError):
            continue  # being written (or a cache we cannot lock): not ours to delete
        removed.append(partial.name)
    if removed:
        log.info("removed %d stale partial download(s) of %s: %s", len(removed), repo_id, ", ".join(removed))
    return removed
