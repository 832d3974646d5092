"""Resolve SOURCE (a local directory, a Hub repo id, or an alias) into the files to convert."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import PrequantError

if TYPE_CHECKING:
    from .hub import HubSource
    from .plan import Step
    from .reader import TensorRef, TensorSource

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"
BIN_INDEX = "pytorch_model.bin.index.json"
BIN_SINGLE = "pytorch_model.bin"
WEIGHT_LAYOUTS = ((SAFETENSORS_INDEX, SAFETENSORS_SINGLE, "safetensors"), (BIN_INDEX, BIN_SINGLE, "bin"))

# Short names for well-known checkpoints (an alias may take a revision: grok-1@main). A local directory of
# the same name wins. Other spellings of the same model are plain repo ids (hpcai-tech/grok-1).
ALIASES: dict[str, str] = {
    "grok-1": "keyfan/grok-1-hf",  # the seed model: 19 pytorch_model-*.bin shards, remote code
}


@dataclass(frozen=True)
class Source:
    """A checkpoint ready to read: its directory, weight files in order, and index if any."""

    spec: str  # what the user typed
    path: Path  # local directory holding config.json and the weights (a Hub source: its cache snapshot)
    weight_files: tuple[Path, ...]  # a streamed Hub source: where each shard will be once downloaded
    index_file: Path | None
    format: str  # "safetensors" or "bin"
    # A Hub source (the manifest records them): the repo, the revision asked for, the commit it resolved to.
    repo_id: str | None = None
    revision: str | None = None
    sha: str | None = None
    hub: HubSource | None = None  # the commit's file listing; None for a local directory

    def describe(self) -> str:
        return f"{self.repo_id}@{self.sha}" if self.hub is not None else str(self.path)

    @property
    def weight_sizes(self) -> dict[str, int]:
        """Each weight file's size, by name (a Hub source's from the commit's listing: shards may be gone)."""
        if self.hub is not None:
            return {p.name: self.hub.files[p.relative_to(self.path).as_posix()] for p in self.weight_files}
        return {p.name: p.stat().st_size for p in self.weight_files}

    def pin(self) -> dict:
        """What identifies a Hub source's weights for a resume (its files are not all on disk to stat)."""
        return {} if self.hub is None else {"hub": {"repo_id": self.repo_id, "commit": self.sha, "files": self.weight_sizes}}


def resolve(spec: str, *, stream: bool = False) -> Source:
    """Find the checkpoint named by `spec`; fail early with what to do when there is none.

    `spec` is a local directory, else a Hub repo ``org/name[@revision]`` or an alias from `ALIASES`. A Hub
    source's small files (config, index, tokenizer, code, card) are downloaded into the Hugging Face cache;
    its weight shards too, unless `stream` (then `scan` reads their headers remotely and `tensors`
    downloads them one by one as a conversion reaches them).
    """
    try:
        path = Path(spec).expanduser()
        exists = path.exists()
    except (OSError, ValueError, RuntimeError) as e:  # name too long, NUL byte, ~unknown-user
        raise PrequantError(f"source {spec!r} is not a usable path ({e}); pass a local checkpoint directory") from e
    if exists:
        return local(spec, path)
    repo = hub_spec(spec)
    if repo is not None:
        from . import hubsource

        return hubsource.resolve(spec, *repo, stream=stream)
    raise PrequantError(
        f"source {spec!r} does not exist; pass a local checkpoint directory (holding config.json and "
        f"*.safetensors weights), a Hub repo as org/name[@revision], or an alias ({', '.join(ALIASES)})"
    )


def hub_spec(spec: str) -> tuple[str, str | None] | None:
    """``(org/name[@revision], alias or None)`` when `spec` names a Hub repo or an alias, else None."""
    name, at, revision = spec.strip().partition("@")
    if name in ALIASES:
        return ALIASES[name] + at + revision, name
    if name.count("/") == 1 and not name.startswith((".", "/", "~")) and not name.endswith("/"):
        return spec.strip(), None
    return None


def scan(src: Source) -> list[TensorRef]:
    """Every tensor of the source, as `reader.scan` gives them (a streamed Hub source: from remote headers)."""
    from . import reader

    if src.hub is not None:
        from . import remote_headers

        return remote_headers.scan(src)
    return reader.scan(src.weight_files)


def tensors(src: Source, steps: tuple[Step, ...], *, delete: bool = False) -> TensorSource:
    """The pipeline's TensorSource; for a Hub source, one that downloads the shards as `steps` reach them.

    `delete` (Hub sources only): evict each shard prequant downloaded from the cache once its tensors are
    written; call the returned object's `step_done(step)` as each step is written."""
    from . import reader

    check_delete(src, delete)
    if src.hub is None:
        return reader.TensorSource()
    from . import hubsource

    return hubsource.HubTensors(src, steps, delete=delete)


def check_delete(src: Source, delete: bool) -> None:
    """Deleting source shards is for a Hub source's downloads only, never for a user's directory."""
    if delete and src.hub is None:
        from .errors import UsageError

        raise UsageError(
            f"--delete-source-shards only applies to a Hub source; {src.path} is a local directory, and prequant "
            "never deletes files there"
        )


def local(spec: str, path: Path) -> Source:
    """A checkpoint in a local directory."""
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
        raise PrequantError(f"{path}: permission denied listing the directory; make it readable") from e
    hint = f" (found {', '.join(found[:5])})" if found else ""
    raise PrequantError(
        f"{path}: no model weights found: expected {SAFETENSORS_SINGLE} or {SAFETENSORS_INDEX}{hint}; "
        "pass the directory of a Hugging Face checkpoint"
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
                f"{index.name}: shard {filename!r} is listed but missing from {root}; the download is incomplete, "
                "download the missing file"
            )
        files[filename] = shard
    return tuple(files.values())


def read_weight_map(index: Path) -> dict[str, str]:
    """An index's weight_map (tensor name -> shard file name), checked to be one."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise TypeError("weight_map must map tensor names to file names")
    except PermissionError as e:
        raise PrequantError(f"{index}: permission denied; make it readable") from e
    except (OSError, ValueError, KeyError, TypeError, IndexError, RecursionError) as e:
        reason = " ".join(str(e).split())[:120] or type(e).__name__
        raise PrequantError(f"{index}: not a valid index (needs a 'weight_map' object: {reason}); re-download it") from e
    return weight_map


def shard_names(root: object, index: Path) -> list[str]:
    """The shard file names an index's weight_map names, in first-mention order; each a plain file name."""
    weight_map = read_weight_map(index)
    files: dict[str, None] = {}
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
        files[filename] = None
    if not files:
        raise PrequantError(f"{index}: the index lists no tensors; re-download it")
    return list(files)


def _plain_file_name(name: str) -> bool:
    """A bare file name: no directory part (either separator), not '.' or '..', no NUL byte."""
    return bool(name) and name not in (".", "..") and not any(c in name for c in "/\\\0")
