"""The output directory: assembled in a hidden staging folder, published with config.json last.

A loader recognises a checkpoint by config.json plus weights; until the very end they exist only under
OUTPUT_DIR/.prequant-staging/, so an interrupted run leaves nothing that looks complete.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from .errors import PrequantError, UsageError

STAGING = ".prequant-staging"
# What a previous conversion into the same directory may have left and a new one replaces.
_REPLACED = ("config.json", "model.safetensors.index.json", "pytorch_model.bin.index.json", "prequant.json")
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


def publish(output_dir: Path, staging: Path, last: tuple[str, ...] = ("model.safetensors.index.json", "config.json")) -> None:
    """Move everything from staging into OUTPUT_DIR; the files in `last` go last, in that order.

    With --overwrite, the old checkpoint's config and index go first, so that at no moment does the
    directory hold an old config over a mix of old and new shards.
    """
    for name in _REPLACED:
        (output_dir / name).unlink(missing_ok=True)
    for pattern in _REPLACED_GLOBS:
        for old in output_dir.glob(pattern):
            old.unlink()
    files = sorted(p.relative_to(staging) for p in staging.rglob("*") if p.is_file())
    order = sorted(files, key=lambda rel: (rel.as_posix() in last, last.index(rel.as_posix()) if rel.as_posix() in last else 0))
    for rel in order:
        target = output_dir / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(staging / rel, target)
    shutil.rmtree(staging, ignore_errors=True)
    _fsync_dir(output_dir)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
