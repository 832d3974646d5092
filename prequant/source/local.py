"""A checkpoint in a local directory: which of Hugging Face's layouts it has, and its weight files in order."""

from __future__ import annotations

from pathlib import Path

from ..checkpoint.hf_files import SAFETENSORS_INDEX, SAFETENSORS_SINGLE, WEIGHT_LAYOUTS, shard_names
from ..errors import PrequantError
from .spec import Source


def local(spec: str, path: Path) -> Source:
    """The checkpoint in directory `path` (`spec`: what the user typed)."""
    if not path.is_dir():
        raise PrequantError(f"source {spec!r} is a file, not a directory; pass the checkpoint's directory")
    for index_name, single, fmt in WEIGHT_LAYOUTS:
        index = path / index_name
        if index.is_file():
            return Source(spec, path, _files_from_index(path, index), index, fmt)
        if (path / single).is_file():
            return Source(spec, path, (path / single,), None, fmt)
    try:
        found = sorted(p.name for p in path.iterdir() if p.suffix in (".safetensors", ".bin", ".pt", ".pth", ".gguf"))
    except PermissionError as e:
        raise PrequantError("permission denied listing the directory; make it readable", where=path) from e
    hint = f" (found {', '.join(found[:5])})" if found else ""
    raise PrequantError(
        f"no model weights found: expected {SAFETENSORS_SINGLE} or {SAFETENSORS_INDEX}{hint}; pass the directory "
        "of a Hugging Face checkpoint",
        where=path,
    )


def _files_from_index(root: Path, index: Path) -> tuple[Path, ...]:
    """The shard files an index names, in first-mention order, each checked to exist inside `root`."""
    files: dict[str, Path] = {}
    for filename in shard_names(root, index):
        shard = root / filename
        try:
            present = shard.is_file()
        except OSError:  # e.g. a name longer than the filesystem allows: it cannot be there
            present = False
        if not present:
            raise PrequantError(
                f"shard {filename!r} is listed but missing from {root}; the download is incomplete, download the "
                "missing file",
                where=index.name,
            )
        files[filename] = shard
    return tuple(files.values())
