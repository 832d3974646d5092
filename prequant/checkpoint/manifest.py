"""OUTPUT_DIR/prequant.json, the manifest: its format, how it is read and checked, and the file hash it records.

It lists every output file with its size and sha256, where the weights came from, the versions and options
used, which tensors were quantized transposed (GPT-2 Conv1D: `verify --source` needs to know, and a square
weight's shape cannot tell), and per-tensor error statistics. A conversion writes it (`conversion.record`);
verify and upload read it.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import platform
from importlib import metadata as importlib_metadata
from collections.abc import Iterable
from pathlib import Path
from typing import Any, BinaryIO

from .._version import __version__
from ..errors import PrequantError

MANIFEST = "prequant.json"
FORMAT = "prequant-manifest"
FORMAT_VERSION = 2  # 2 adds "transposed"; readers accept manifests without it (version 1)
READ_CHUNK = 8 * 1024 * 1024  # hashlib releases the GIL on large updates: hashing runs beside the pipeline
_PACKAGES = ("torch", "bitsandbytes", "transformers", "safetensors", "huggingface_hub")


def sha256_file(path: Path | BinaryIO, on_bytes: Any = None, *, mapped: bool = False) -> str:
    """Hex sha256 of a file (a path, or a file open for reading, which is closed), read in large chunks;
    `on_bytes(n)` is called as bytes go by (progress).

    `mapped`: hash the page cache in place through a memory map rather than copying it out (faster: no copy),
    which shortens the tail of a conversion, where the last shard is hashed. Only for files this process has just written: if another process truncated the file
    meanwhile, reading the map would kill this one (SIGBUS), so files from elsewhere are read."""
    digest = hashlib.sha256()
    with (open(path, "rb", buffering=0) if isinstance(path, (str, Path)) else path) as f:
        if mapped and (size := os.fstat(f.fileno()).st_size):
            with mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ) as m:
                m.madvise(mmap.MADV_SEQUENTIAL)
                with memoryview(m) as view:
                    for start in range(0, size, READ_CHUNK):
                        n = min(READ_CHUNK, size - start)
                        digest.update(view[start:start + n])
                        # Unmap what was hashed (the page cache keeps it): else the whole shard counts in
                        # this process' RSS, a whole shard's worth of it.
                        m.madvise(mmap.MADV_DONTNEED, start, n)
                        if on_bytes is not None:
                            on_bytes(n)
            return digest.hexdigest()
        buf = bytearray(READ_CHUNK)
        view = memoryview(buf)
        while n := f.readinto(buf):
            digest.update(view[:n])
            if on_bytes is not None:
                on_bytes(n)
    return digest.hexdigest()


def versions() -> dict[str, str | None]:
    """prequant's version and those of the libraries that decide the bytes (None when not installed)."""
    found: dict[str, str | None] = {"prequant": __version__, "python": platform.python_version()}
    for name in _PACKAGES:
        try:
            found[name] = importlib_metadata.version(name)
        except importlib_metadata.PackageNotFoundError:
            found[name] = None
    return found


def unlisted(output_dir: Path, listed: Iterable[str]) -> list[str]:
    """The files under OUTPUT_DIR (relative paths) that are not part of its checkpoint: neither among `listed` (its
    prequant.json's files) nor prequant.json itself. What verify reports and `prequant upload` refuses to publish
    with the checkpoint."""
    names = {*listed, MANIFEST}
    found = (p.relative_to(output_dir).as_posix() for p in sorted(output_dir.rglob("*")) if p.is_file())
    return [rel for rel in found if rel not in names]


def load(output_dir: Path) -> dict:
    """Read and sanity-check OUTPUT_DIR/prequant.json; PrequantError (one line) if absent or malformed."""
    path = output_dir / MANIFEST
    if not path.is_file():
        raise PrequantError(
            f"missing from {output_dir}; only a complete prequant conversion has one, convert again", where=MANIFEST
        )
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise PrequantError(f"not valid JSON ({e}); the file is corrupt, convert again", where=MANIFEST) from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise PrequantError(f"not a prequant manifest (no \"format\": \"{FORMAT}\"); convert again", where=MANIFEST)
    files = manifest.get("files")
    if not isinstance(files, dict) or not all(
        isinstance(v, dict) and isinstance(v.get("size"), int) and isinstance(v.get("sha256"), str) for v in files.values()
    ):
        raise PrequantError("its \"files\" table is malformed; the file is corrupt, convert again", where=MANIFEST)
    transposed = manifest.get("transposed")  # absent from version 1 manifests
    if transposed is not None and not (isinstance(transposed, list) and all(isinstance(n, str) for n in transposed)):
        raise PrequantError("its \"transposed\" list is malformed; the file is corrupt, convert again", where=MANIFEST)
    return manifest
