"""The output directory: checked before anything slow, claimed by one conversion at a time, assembled in a hidden
staging folder, published with config.json last.

A loader recognises a checkpoint by config.json plus weights; until the very end they exist only under
OUTPUT_DIR/.prequant-staging/, so an interrupted run leaves nothing that looks complete. The staging folder holds
the job's fingerprint and journal (`journal`): the same conversion run again continues there. Standard library
and filelock only: the CLI checks OUTPUT_DIR here before torch is imported.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock, Timeout

from ..checkpoint.hf_files import CONFIG, INDEX_NAMES
from ..checkpoint.manifest import MANIFEST, unlisted
from ..errors import PrequantError, UsageError, flag
from ..util import failpoints
from .journal import JOB, JOURNAL, job_id

STAGING = ".prequant-staging"
LOCK = ".prequant.lock"
PUBLISHING = "PUBLISHING"  # marker: everything is written, files are being moved into place
_BOOKKEEPING = (JOB, JOURNAL, PUBLISHING)
# What a previous conversion into the same directory may have left and a new one replaces.
_REPLACED = (CONFIG, *INDEX_NAMES, MANIFEST)
_REPLACED_GLOBS = ("model*.safetensors", "pytorch_model*.bin")


def target(output_dir: str | Path, source: str | Path, *, overwrite: bool, resume: bool, dry_run: bool = False) -> Path:
    """OUTPUT_DIR as a Path, refused (UsageError, nothing touched) when a conversion of `source` (SOURCE as given, or
    a directory) must not write there: an empty name (an unset variable: it would mean the current directory), a
    file, the source directory or a folder inside it, or a directory holding anything but a prequant conversion
    without --overwrite (which conversion, `claim` says once the job is known). A dry run writes nothing: only
    the name is checked. A refusal names the options as its caller writes them (flags or keywords)."""
    if not str(output_dir).strip():
        raise UsageError("OUTPUT_DIR is empty (an unset variable?); pass the directory to write the checkpoint to")
    out = Path(output_dir)
    if dry_run:
        return out
    source_dir = _local_dir(source)
    try:
        exists, is_dir = out.exists(), out.is_dir()
        inside = _inside(out, source_dir) if source_dir is not None else None
    except (OSError, RuntimeError) as e:  # a name longer than the filesystem allows, a loop of links, ...
        raise UsageError(f"OUTPUT_DIR {str(out)[:200]!r} is not a usable path ({e.strerror or e}); choose another") from e
    if exists and not is_dir:
        raise UsageError(f"OUTPUT_DIR {out} is a file; choose a directory")
    if inside is not None:
        raise UsageError(inside)
    check_contents(out, overwrite=overwrite, resume=resume)
    return out


def _local_dir(source: str | Path) -> Path | None:
    """SOURCE's directory when it names one here (else a Hub repo, or a name `resolve` refuses)."""
    try:
        path = Path(source).expanduser()
        return path if path.is_dir() else None
    except (OSError, ValueError, RuntimeError):
        return None


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
    """Refuse an OUTPUT_DIR that holds anything but a prequant conversion (interrupted or finished), unless
    --overwrite."""
    if not output_dir.is_dir() or overwrite:
        return
    existing = _entries(output_dir)
    if not existing or interrupted(output_dir) or (output_dir / MANIFEST).is_file():
        return
    what = (f" and holds no interrupted conversion to resume ({flag('resume')} only continues one)"
            if resume else "")
    held = f"{len(existing)} entries, e.g. {existing[0]}" if len(existing) > 1 else existing[0]
    raise UsageError(f"OUTPUT_DIR {output_dir} is not empty (it holds {held}){what}; pass {flag('overwrite')} to "
                     "replace the checkpoint in it, or choose an empty directory")


def _entries(output_dir: Path) -> list[str]:
    return sorted(p.name for p in output_dir.iterdir() if p.name not in (STAGING, LOCK))


def interrupted(output_dir: Path) -> bool:
    """Whether OUTPUT_DIR holds an interrupted conversion (its journal, or a publish cut short)."""
    staging = output_dir / STAGING
    return (staging / JOB).is_file() or (staging / PUBLISHING).exists()


@dataclass(frozen=True)
class Claim:
    """OUTPUT_DIR, locked for one conversion: its staging folder (an interrupted run's of the same job, continued,
    or a new one), or `complete`: the same job is finished there already."""

    output_dir: Path
    staging: Path
    complete: bool


@contextmanager
def claim(output_dir: Path, job: dict | str, *, overwrite: bool, resume: bool, options: dict | None = None) -> Iterator[Claim]:
    """Lock OUTPUT_DIR for the conversion whose fingerprint is `job` ("": not a conversion, nothing to continue),
    check it again under the lock, and decide what happens to what is there: an interrupted run of the same job is
    continued, a finished one is complete; another job's work is refused (UsageError, one line) unless
    --overwrite, which starts over. `options`: what this job's prequant.json will record as its options, so that a
    refusal of a finished job names those that differ (as its caller writes them)."""
    with _locked(output_dir):
        check_contents(output_dir, overwrite=overwrite, resume=resume)
        staging = output_dir / STAGING
        staged = _staged_job(staging)
        if staged is not None and staged != job and not overwrite:
            raise UsageError(f"OUTPUT_DIR {output_dir} holds an interrupted conversion of another job ({_changed(staged, job)} "
                             f"changed since it started); rerun it as it was to continue it, or pass "
                             f"{flag('overwrite')} to start over")
        complete = staged is None and _finished(output_dir, job, overwrite=overwrite, options=options)
        if staged != job and staging.exists():
            shutil.rmtree(staging)  # another job's work (with --overwrite), or files of no job at all
        yield Claim(output_dir, staging if complete else staging_dir(output_dir), complete)


def _finished(output_dir: Path, job: dict | str, *, overwrite: bool, options: dict | None) -> bool:
    """Whether OUTPUT_DIR holds `job` finished, intact; another finished checkpoint is refused unless --overwrite."""
    if not (output_dir / MANIFEST).is_file():
        if job or overwrite or not _entries(output_dir):
            return False
        raise UsageError(f"OUTPUT_DIR {output_dir} is not empty; pass {flag('overwrite')} to replace the "
                         "checkpoint in it, or choose an empty directory")
    written = _manifest(output_dir)
    found = written.get("job") if written is not None else None
    if found is not None and job and found == job_id(job):
        if not (changed := changed_files(output_dir, written)):
            return True
        if not overwrite:
            raise UsageError(f"OUTPUT_DIR {output_dir} holds this conversion, finished, but {changed} since; run "
                             f"`prequant verify` on it, or pass {flag('overwrite')} to convert again")
    if overwrite:
        return False
    if found is None:
        raise UsageError(f"OUTPUT_DIR {output_dir} holds a finished checkpoint that no conversion of these options "
                         f"wrote (e.g. the result of prequant change-storage); pass {flag('overwrite')} to "
                         "replace it, or choose an empty directory")
    assert written is not None
    if differ := _options_differ(written, options or {}):
        what = f"with other options ({differ})"
    elif isinstance(job, dict) and "adapter" in job and isinstance(written.get("adapter"), dict) \
            and written["adapter"].get("sha256") != job["adapter"].get("sha256"):
        what = "of another adapter (its files differ from this one's)"
    else:
        what = "of another source (or by another prequant version)"
    raise UsageError(f"OUTPUT_DIR {output_dir} holds a finished conversion {what}; pass {flag('overwrite')} "
                     "to replace it, or choose an empty directory")


# Options prequant.json records that a refusal leaves unnamed: the skip list transformers is given follows from
# --skip (named instead), and --no-stats changes no weight.
_NOT_SAID = ("stats", "llm_int8_skip_modules")


def _options_differ(written: dict, options: dict) -> str:
    """The options whose values differ between OUTPUT_DIR's prequant.json (`written`) and `options` (this job's),
    in words: "--quant-type: nf4 there, fp4 here"; "" when none does."""
    recorded = written.get("options")
    if not isinstance(recorded, dict):
        return ""
    differ = [k for k, v in options.items() if k in recorded and recorded[k] != v and k not in _NOT_SAID]
    return ", ".join(f"{flag(k, None)}: {recorded[k]!r} there, {options[k]!r} here" for k in differ)


def _staged_job(staging: Path) -> dict | None:
    """The fingerprint of the interrupted conversion in the staging folder, if any."""
    try:
        job = json.loads((staging / JOB).read_text())
    except (OSError, ValueError):
        return None
    return job if isinstance(job, dict) else None


def _changed(staged: dict, job: dict | str) -> str:
    """What differs between an interrupted conversion's fingerprint and this one's, in words."""
    if not isinstance(job, dict):
        return "the command"
    if staged.get("source_files") != job.get("source_files") or staged.get("hub") != job.get("hub"):
        return "the source files"
    if staged.get("adapter") != job.get("adapter"):
        return "the adapter's files"
    if staged.get("prequant") != job.get("prequant"):
        return "prequant's version"
    return "the options"


def changed_files(output_dir: Path, written: dict | None = None) -> str | None:
    """What no longer matches the manifest's sizes in a finished output ("x is missing", ...), else None.
    `written`: its prequant.json, when read already."""
    files = (written if written is not None else json.loads((output_dir / MANIFEST).read_text())).get("files", {})
    for name, entry in sorted(files.items()):
        path = output_dir / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != entry.get("size"):
            return f"{name} changed size"
    return None


def _manifest(output_dir: Path) -> dict | None:
    """OUTPUT_DIR's prequant.json, None when it is unreadable or not an object."""
    try:
        manifest = json.loads((output_dir / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None


@contextmanager
def _locked(output_dir: Path) -> Iterator[None]:
    """One conversion per OUTPUT_DIR: the kernel's lock (flock) on OUTPUT_DIR/.prequant.lock, taken without waiting.

    A run killed by SIGKILL or a crash releases it with its file descriptor, so a stale file never blocks. The file
    says who holds it, for the message another run gets, and is removed before the release (filelock then takes
    the path again in a run that opened the removed file), so nothing of it is published."""
    path = output_dir / LOCK
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        lock = FileLock(path, timeout=0, on_acquired=_write_holder)
        lock.acquire()
    except Timeout:
        raise PrequantError(f"OUTPUT_DIR {output_dir} is in use by another prequant conversion ({_holder(path)}); "
                            "wait for it to finish or stop it, or choose another OUTPUT_DIR") from None
    except PermissionError as e:
        raise PrequantError(f"{output_dir}: permission denied ({e.strerror}); choose a writable OUTPUT_DIR") from e
    except OSError as e:
        raise PrequantError(f"{output_dir}: cannot create the output ({e.strerror}); choose another OUTPUT_DIR") from e
    try:
        yield
    finally:
        try:
            path.unlink(missing_ok=True)
        except OSError:
            pass  # an OUTPUT_DIR that vanished or turned read-only: the lock itself still goes with the release
        lock.release()


def _write_holder(fd: int) -> None:
    record = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "command": sys.argv}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(record).encode(), 0)


def _holder(path: Path) -> str:
    """Who holds the lock, from what it wrote into the file."""
    try:
        record = json.loads(path.read_bytes() or b"{}")
        pid, host = int(record["pid"]), str(record["host"])
    except (OSError, ValueError, KeyError, TypeError):
        return "a process that is still starting"
    where = "this host" if host == socket.gethostname() else f"host {host}"
    started = f", started {record['started']}" if isinstance(record.get("started"), str) else ""
    return f"pid {pid} on {where}{started}"


def staging_dir(output_dir: Path) -> Path:
    """The staging folder inside OUTPUT_DIR, created (kept when it exists) and checked writable."""
    staging = output_dir / STAGING
    try:
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

    The old checkpoint's config and index (with --overwrite) go first, so that at no moment does the directory hold
    an old config over a mix of old and new shards. A publish interrupted half-way is finished by the same
    conversion run again (the marker says the old files are already gone).
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


def unrelated_files(output_dir: Path) -> list[str]:
    """The files of a finished OUTPUT_DIR that its prequant.json does not list (--overwrite keeps a user's own
    files): what `prequant upload` refuses to publish with it (`manifest.unlisted`, as verify finds them)."""
    written = _manifest(output_dir)
    listed = written.get("files") if written is not None else None
    return unlisted(output_dir, listed) if isinstance(listed, dict) else []


def publishing(staging: Path) -> bool:
    """True when an interrupted run had finished writing and was moving files into place."""
    return (staging / PUBLISHING).exists()
