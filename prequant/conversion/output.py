"""The output directory: checked before anything is written, locked for one conversion, assembled in a hidden
staging folder, published with config.json last.

A loader recognises a checkpoint by config.json plus weights; until the very end they exist only under
OUTPUT_DIR/.prequant-staging/, so an interrupted run leaves nothing that looks complete.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ..checkpoint.hf_files import CONFIG, INDEX_NAMES
from ..checkpoint.manifest import MANIFEST
from ..errors import PrequantError, UsageError
from ..util import failpoints
from .journal import JOB, JOURNAL
from .lock import LOCK, OutputLock

STAGING = ".prequant-staging"
PUBLISHING = "PUBLISHING"  # marker: everything is written, files are being moved into place
_BOOKKEEPING = (JOB, JOURNAL, PUBLISHING)
# What a previous conversion into the same directory may have left and a new one replaces.
_REPLACED = (CONFIG, *INDEX_NAMES, MANIFEST)
_REPLACED_GLOBS = ("model*.safetensors", "pytorch_model*.bin")


def target(output_dir: str | Path, source_dir: Path, *, overwrite: bool, resume: bool, dry_run: bool = False) -> Path:
    """OUTPUT_DIR as a Path, refused (UsageError, nothing touched) when a conversion must not write there: an
    empty name (an unset variable: it would mean the current directory), a file, the source directory or a
    folder inside it, or a non-empty directory without --overwrite (or, with --resume, an interrupted or
    finished conversion in it). A dry run writes nothing: only the name is checked."""
    if not str(output_dir).strip():
        raise UsageError("OUTPUT_DIR is empty (an unset variable?); pass the directory to write the checkpoint to")
    out = Path(output_dir)
    if dry_run:
        return out
    try:
        exists, is_dir = out.exists(), out.is_dir()
        inside = _inside(out, source_dir)
    except (OSError, RuntimeError) as e:  # a name longer than the filesystem allows, a loop of links, ...
        raise UsageError(f"OUTPUT_DIR {str(out)[:200]!r} is not a usable path ({e.strerror or e}); choose another") from e
    if exists and not is_dir:
        raise UsageError(f"OUTPUT_DIR {out} is a file; choose a directory")
    if inside is not None:
        raise UsageError(inside)
    check_contents(out, overwrite=overwrite, resume=resume)
    return out


def _inside(out: Path, source_dir: Path) -> str | None:
    """Why OUTPUT_DIR cannot be where it is relative to SOURCE (None: it can)."""
    source, resolved = source_dir.resolve(), out.resolve()
    if resolved == source:
        return (f"OUTPUT_DIR {out} is the source directory; writing there would replace the original weights, "
                "choose another OUTPUT_DIR")
    if resolved.is_relative_to(source):
        return (f"OUTPUT_DIR {out} is inside the source directory {source_dir}; the output would become part of the "
                f"source (copied into the next conversion of it), choose an OUTPUT_DIR outside it, e.g. "
                f"{source.parent / (source.name + '-nf4')}")
    return None


def check_contents(output_dir: Path, *, overwrite: bool, resume: bool) -> None:
    """Refuse an OUTPUT_DIR that holds anything but our own bookkeeping, unless --overwrite, or --resume finds an
    interrupted (or finished: see `claim`) conversion there."""
    if not output_dir.is_dir() or overwrite:
        return
    existing = sorted(p.name for p in output_dir.iterdir() if p.name not in (STAGING, LOCK))
    if not existing:
        return
    if resume and (interrupted(output_dir) or (output_dir / MANIFEST).is_file()):
        return
    what = (" and holds no interrupted conversion to resume (--resume only continues one)" if resume else "")
    held = f"1 entry: {existing[0]}" if len(existing) == 1 else f"{len(existing)} entries, e.g. {existing[0]}"
    raise UsageError(
        f"OUTPUT_DIR {output_dir} is not empty ({held}){what}; pass --overwrite "
        "to replace the checkpoint in it, or choose an empty directory"
    )


def interrupted(output_dir: Path) -> bool:
    """Whether OUTPUT_DIR holds an interrupted conversion (its journal, or a publish cut short)."""
    staging = output_dir / STAGING
    return (staging / JOB).is_file() or (staging / PUBLISHING).exists()


@dataclass(frozen=True)
class Claim:
    """OUTPUT_DIR, locked for one conversion; `complete`: --resume found this very job finished there."""

    output_dir: Path
    complete: bool


@contextmanager
def claim(output_dir: Path, job_id: str, *, overwrite: bool, resume: bool) -> Iterator[Claim]:
    """Lock OUTPUT_DIR for this conversion (`lock`) and check it again under the lock (a run that finished
    meanwhile has filled it). With --resume and no interrupted conversion there, a finished output of the same
    job (`job_id`, recorded in prequant.json) is complete already; one of another job is refused."""
    with OutputLock(output_dir):
        check_contents(output_dir, overwrite=overwrite, resume=resume)
        complete = False
        if resume and not interrupted(output_dir) and (output_dir / MANIFEST).is_file():
            if (found := _job_of(output_dir)) != job_id:
                if found is None:
                    raise UsageError(
                        f"OUTPUT_DIR {output_dir} holds a finished checkpoint that no conversion of these options wrote "
                        "(e.g. the result of prequant change-storage), not an interrupted one; pass --overwrite to "
                        "replace it, or choose an empty directory"
                    )
                raise UsageError(
                    f"OUTPUT_DIR {output_dir} holds a finished conversion of another source or with other options, "
                    "not an interrupted one (--resume only continues an interrupted conversion); pass --overwrite to "
                    "replace it, or choose an empty directory"
                )
            if changed := _changed_files(output_dir):
                raise UsageError(
                    f"OUTPUT_DIR {output_dir} holds this conversion, finished, but {changed} since; run `prequant "
                    "verify` on it, or pass --overwrite to convert again"
                )
            complete = True
        yield Claim(output_dir, complete)


def _changed_files(output_dir: Path) -> str | None:
    """What no longer matches the manifest's sizes in a finished output ("x is missing", ...), else None."""
    files = json.loads((output_dir / MANIFEST).read_text()).get("files", {})
    for name, entry in sorted(files.items()):
        path = output_dir / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != entry.get("size"):
            return f"{name} changed size"
    return None


def _job_of(output_dir: Path) -> str | None:
    try:
        manifest = json.loads((output_dir / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return manifest.get("job") if isinstance(manifest, dict) else None


def staging_dir(output_dir: Path, keep: bool = False) -> Path:
    """Create (or, with keep, reuse) the staging folder inside OUTPUT_DIR."""
    staging = output_dir / STAGING
    try:
        if staging.exists() and not keep:
            shutil.rmtree(staging)
        staging.mkdir(parents=True, exist_ok=True)
        probe = staging / ".write-test"
        probe.write_bytes(b"")
        probe.unlink()
    except PermissionError as e:
        raise PrequantError(f"{output_dir}: permission denied ({e.strerror}); choose a writable OUTPUT_DIR") from e
    except OSError as e:
        raise PrequantError(f"{output_dir}: cannot create the output ({e.strerror}); choose another OUTPUT_DIR") from e
    return staging


# Published last, in this order: the files that make the directory look like a complete checkpoint.
_LAST = (INDEX_NAMES[0], CONFIG)


def publish(output_dir: Path, staging: Path) -> None:
    """Move everything from staging into OUTPUT_DIR; the files in `_LAST` go last, in that order.

    With --overwrite, the old checkpoint's config and index go first, so that at no moment does the
    directory hold an old config over a mix of old and new shards. A publish interrupted half-way is
    finished by the next run with --resume (the marker says the old files are already gone).
    """
    marker = staging / PUBLISHING
    if not marker.exists():
        for name in _REPLACED:
            (output_dir / name).unlink(missing_ok=True)
        for pattern in _REPLACED_GLOBS:
            for old in output_dir.glob(pattern):
                old.unlink()
        marker.write_text("")
    files = sorted(
        p.relative_to(staging) for p in staging.rglob("*") if p.is_file() and p.relative_to(staging).as_posix() not in _BOOKKEEPING
    )
    order = sorted(files, key=lambda rel: (rel.as_posix() in _LAST, _LAST.index(rel.as_posix()) if rel.as_posix() in _LAST else 0))
    for rel in order:
        target = output_dir / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(staging / rel, target)
        failpoints.hit("publish-file")
    shutil.rmtree(staging, ignore_errors=True)
    _fsync_dir(output_dir)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publishing(staging: Path) -> bool:
    """True when an interrupted run had finished writing and was moving files into place."""
    return (staging / PUBLISHING).exists()
