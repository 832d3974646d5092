"""The files of a folder peft's `save_pretrained` writes, known without torch: `adapter` reads them, and the CLI
peeks at a local one before the libraries load, to read it and its base ahead (`conversion.readahead.prefetch`)
and to hash its files (`hash_ahead`), which the job's fingerprint names by their sha256."""

from __future__ import annotations

import json
import os
import threading
from concurrent.futures import Future
from pathlib import Path

from ..checkpoint.hf_files import ADAPTER_CONFIG, ADAPTER_FILES
from ..checkpoint.manifest import sha256_file

CONFIG_NAME = ADAPTER_CONFIG
WEIGHT_NAMES = ADAPTER_FILES[1:]  # peft writes one; the first found is read


def check(spec: str) -> None:
    """Refuse an ADAPTER that is neither a local folder nor a Hub repo id (a mistyped path: `./x`, `work/x` where
    ./work is a folder, ...; an alias names a model, not an adapter) at once, from its spelling and the disk, as
    SOURCE is refused: never a question for the Hub."""
    from ..source.spec import where

    where(spec, what="ADAPTER", aliases=False, local="local adapter folder")


def peek(spec: str) -> tuple[list[Path], str | None]:
    """A local adapter folder's weight file and the base its config names (base_model_name_or_path); nothing
    for anything else. Advisory: whatever is wrong with the folder is for `adapter.read` to report."""
    path = Path(spec).expanduser()
    try:
        weights = [path / n for n in WEIGHT_NAMES if (path / n).is_file()][:1]
        config = json.loads((path / CONFIG_NAME).read_text())
        base = config.get("base_model_name_or_path") if isinstance(config, dict) else None
        return weights, base if isinstance(base, str) else None
    except (OSError, ValueError):
        return [], None


# Files hashed ahead, by real path: what the hash gave (the file's identity while hashed, and its digest).
_ahead: dict[str, Future[tuple[tuple[int, ...], str]]] = {}


def hash_ahead(spec: str) -> None:
    """From the CLI, before torch's import: hash a local adapter folder's config and weights on a thread of their
    own, while the libraries load, so that the job's fingerprint (`sha256`) finds them done. Nothing for anything
    but a folder; advisory: a file that cannot be read is hashed again when asked for, which reports it."""
    path = Path(spec).expanduser()
    files = [path / n for n in (CONFIG_NAME, *WEIGHT_NAMES) if (path / n).is_file()]
    jobs = [(file, Future()) for file in files if os.path.realpath(file) not in _ahead]
    _ahead.update((os.path.realpath(file), future) for file, future in jobs)
    if jobs:
        threading.Thread(target=_hash_all, args=(jobs,), name="prequant-adapter-hash", daemon=True).start()


def sha256(path: Path) -> str:
    """`path`'s sha256: the digest `hash_ahead` made if the file is still the one it hashed, else hashed now."""
    ahead = _ahead.pop(os.path.realpath(path), None)
    if ahead is not None:
        try:
            ident, digest = ahead.result()
            if ident == _ident(path):
                return digest
        except Exception:  # noqa: BLE001, S110 - hashed again below, which says what is wrong
            pass
    return sha256_file(path)


def _hash_all(jobs: list[tuple[Path, Future[tuple[tuple[int, ...], str]]]]) -> None:
    for file, future in jobs:
        try:
            before = _ident(file)
            digest = sha256_file(file)
            # Changed while being hashed: an identity no file has, so that `sha256` hashes it again.
            future.set_result((before if _ident(file) == before else (), digest))
        except Exception as e:  # noqa: BLE001 - for `sha256`, which then hashes the file itself
            future.set_exception(e)


def _ident(path: Path) -> tuple[int, ...]:
    """What tells a file from its replacement or its rewrite: device, inode, size and modification time."""
    st = os.stat(path)
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
