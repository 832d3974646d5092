"""Writing files: JSON written atomically, and a failed write said in one line (a full disk says how to go on)."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

from ..errors import PrequantError

# A full disk, a full quota and a file-size limit (EFBIG, e.g. ulimit -f) all mean: make room, then resume.
FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def disk_full(path: Path, needed: int) -> PrequantError:
    """The error for a write into `path` that found no room (`needed`: bytes still to write, 0 if unknown)."""
    more = f"needed {needed:,} more bytes for {path.name}" if needed else f"writing {path.name}"
    return PrequantError(
        f"no space left on the device ({more}); free space and run the same command again", where=path.parent
    )


def write_error(path: Path, e: OSError) -> PrequantError:
    """A failed write as a one-line error: a full disk says how to continue, anything else names the file."""
    if e.errno in FULL:
        return disk_full(path, 0)
    if isinstance(e, PermissionError):
        return PrequantError(f"permission denied writing {path.name}; choose a writable OUTPUT_DIR", where=path.parent)
    return PrequantError(f"write failed ({e.strerror or e}); check the disk, then run the same command again",
                         where=path)


def write_json(path: Path, obj: object, *, sort_keys: bool = True) -> None:
    """Write JSON atomically (temp file + rename), indented as transformers writes it."""
    tmp = path.with_name(path.name + ".partial")
    try:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=sort_keys) + "\n")
        os.replace(tmp, path)
    except OSError as e:
        raise write_error(tmp, e) from e
