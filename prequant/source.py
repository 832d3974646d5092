"""Resolve SOURCE (a local directory, a Hub repo id, or an alias) into the files to convert."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .errors import PrequantError

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"
BIN_INDEX = "pytorch_model.bin.index.json"
BIN_SINGLE = "pytorch_model.bin"


@dataclass(frozen=True)
class Source:
    """A checkpoint ready to read: its directory, weight files in order, and index if any."""

    spec: str  # what the user typed
    path: Path  # local directory holding config.json and the weights
    weight_files: tuple[Path, ...]
    index_file: Path | None
    format: str  # "safetensors" or "bin"

    def describe(self) -> str:
        return str(self.path)


def resolve(spec: str) -> Source:
    """Find the checkpoint named by `spec`; fail early with what to do when there is none."""
    try:
        path = Path(spec).expanduser()
        exists = path.exists()
    except (OSError, ValueError, RuntimeError) as e:  # name too long, NUL byte, ~unknown-user
        raise PrequantError(f"source {spec!r} is not a usable path ({e}); pass a local checkpoint directory") from e
    if exists:
        return local(spec, path)
    raise PrequantError(
        f"source {spec!r} does not exist; pass a local checkpoint directory (holding config.json and "
        "*.safetensors weights)"
    )


def local(spec: str, path: Path) -> Source:
    """A checkpoint in a local directory."""
    if not path.is_dir():
        raise PrequantError(f"source {spec!r} is a file, not a directory; pass the checkpoint's directory")
    for index_name, single, fmt in (
        (SAFETENSORS_INDEX, SAFETENSORS_SINGLE, "safetensors"),
        (BIN_INDEX, BIN_SINGLE, "bin"),
    ):
        index = path / index_name
        if index.is_file():
            return Source(spec, path, _files_from_index(path, index), index, fmt)
        if (path / single).is_file():
            return Source(spec, path, (path / single,), None, fmt)
    try:
        found = sorted(p.name for p in path.iterdir() if p.suffix in (".safetensors", ".bin", ".pt", ".pth", ".gguf"))
    except PermissionError as e:
        raise PrequantError(f"{path}: permission denied listing the directory; make it readable") from e
    hint = f" (found {', '.join(found[:5])})" if found else ""
    raise PrequantError(
        f"{path}: no model weights found: expected {SAFETENSORS_SINGLE} or {SAFETENSORS_INDEX}{hint}; "
        "pass the directory of a Hugging Face checkpoint"
    )


def _files_from_index(root: Path, index: Path) -> tuple[Path, ...]:
    """The shard files an index names, in first-mention order, each checked to exist inside `root`."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise TypeError("weight_map must map tensor names to file names")
    except PermissionError as e:
        raise PrequantError(f"{index}: permission denied; make it readable") from e
    except (OSError, ValueError, KeyError, TypeError, IndexError, RecursionError) as e:
        reason = " ".join(str(e).split())[:120] or type(e).__name__
        raise PrequantError(f"{index}: not a valid index ({reason}); re-download it") from e
    files: dict[str, Path] = {}
    for filename in weight_map.values():
        if filename in files:
            continue
        # An index is data from the internet: a name like "../../etc/passwd" must not make us read
        # (or later delete) anything outside the checkpoint directory. The check is on the name, not on
        # the resolved path: the Hub cache's snapshot folders hold symlinks into ../../blobs, and links the
        # user put in their own directory are theirs to make.
        if not _plain_file_name(filename):
            raise PrequantError(
                f"{index.name}: shard name {filename[:200]!r} points outside {root}; refusing to read it, fix the "
                "index's weight_map (shard names are plain file names)"
            )
        shard = root / filename
        try:
            present = shard.is_file()
        except OSError:  # e.g. a name longer than the filesystem allows: it cannot be there
            present = False
        if not present:
            raise PrequantError(
                f"{index.name}: shard {filename!r} is listed but missing from {root}; the download is incomplete, "
                "download the missing file"
            )
        files[filename] = shard
    if not files:
        raise PrequantError(f"{index}: the index lists no tensors; re-download it")
    return tuple(files.values())


def _plain_file_name(name: str) -> bool:
    """A bare file name: no directory part (either separator), not '.' or '..', no NUL byte."""
    return bool(name) and name not in (".", "..") and not any(c in name for c in "/\\\0")
