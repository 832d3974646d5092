"""The output directory: assembled in a hidden staging folder, published with config.json last.

A loader recognises a checkpoint by config.json plus weights; until the very end they exist only under
OUTPUT_DIR/.prequant-staging/, so an interrupted run leaves nothing that looks complete.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from ..checkpoint.hf_files import CONFIG, INDEX_NAMES
from ..checkpoint.manifest import MANIFEST
from ..errors import PrequantError, UsageError
from ..util import failpoints
from .journal import JOB, JOURNAL

STAGING = ".prequant-staging"
PUBLISHING = "PUBLISHING"  # marker: everything is written, files are being moved into place
_BOOKKEEPING = (JOB, JOURNAL, PUBLISHING)
# What a previous conversion into the same directory may have left and a new one replaces.
_REPLACED = (CONFIG, *INDEX_NAMES, MANIFEST)
_REPLACED_GLOBS = ("model*.safetensors", "pytorch_model*.bin")


def check(output_dir: Path, overwrite: bool) -> None:
    """Refuse an OUTPUT_DIR that holds anything (but our staging) unless --overwrite."""
    if output_dir.exists() and not output_dir.is_dir():
        raise UsageError(f"OUTPUT_DIR {output_dir} is a file; choose a directory")
    if output_dir.is_dir() and not overwrite:
        existing = [p.name for p in output_dir.iterdir() if p.name != STAGING]
        if existing:
            raise UsageError(
                f"OUTPUT_DIR {output_dir} is not empty ({len(existing)} entries, e.g. {existing[0]}); pass --overwrite "
                "to replace the checkpoint in it, or choose an empty directory"
            )


def check_not_source(output_dir: Path, source_dir: Path) -> None:
    """Refuse OUTPUT_DIR = SOURCE: publishing replaces config.json and model*.safetensors there, the originals."""
    try:
        same = output_dir.exists() and output_dir.samefile(source_dir)
    except OSError:
        same = False
    if same:
        raise UsageError(
            f"OUTPUT_DIR {output_dir} is the source directory; writing there would replace the original weights, "
            "choose another OUTPUT_DIR"
        )


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
