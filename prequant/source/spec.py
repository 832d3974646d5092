"""What a SOURCE names, and where its files are: a local directory (`local`), or a Hub repo resolved to a commit with
its small files downloaded and its weight shards named by the paths they will have in the Hugging Face cache
(`hub`); the `Source` either gives, and what it holds once its headers are read (`Contents`).

Standard library only at import (huggingface_hub is imported for a Hub source alone): the CLI lists a local
source's files before torch loads.
"""

from __future__ import annotations

import difflib
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..checkpoint.hf_files import (
    CONFIG, SAFETENSORS_INDEX, SAFETENSORS_SINGLE, WEIGHT_LAYOUTS, WEIGHT_SUFFIXES, shard_names, weight_layout,
)  # fmt: skip
from ..errors import PrequantError

if TYPE_CHECKING:
    from ..checkpoint.tensors import TensorRef
    from ..hub.client import HubCommit

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
    hub: HubCommit | None = None  # the commit's file listing; None for a local directory

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


@dataclass(frozen=True)
class Contents:
    """What a resolved source holds (`resolve.contents`)."""

    tensors: list[TensorRef]  # every tensor, in file order, checked against the index when there is one
    config: dict  # config.json, checked: a JSON object, not quantized already


# One part of a Hub repo id, as the Hub accepts it: letters, digits, "-", "_", ".", neither "--" nor "..", not
# starting or ending with "-" or ".", at most 96 characters.
_REPO_PART = re.compile(r"^(?!.*(--|\.\.))[A-Za-z0-9_](?:[\w.-]{0,94}[A-Za-z0-9_])?$")


def is_repo_id(text: str) -> bool:
    """Whether `text` is a Hub repo id, `org/name` (no revision), each part as the Hub accepts it."""
    org, slash, name = text.partition("/")
    return bool(slash and _REPO_PART.match(org) and _REPO_PART.match(name))


def hub_spec(spec: str) -> tuple[str, str | None] | None:
    """``(org/name[@revision], alias or None)`` when `spec` names a Hub repo or an alias, else None."""
    name, at, revision = spec.strip().partition("@")
    if name in ALIASES:
        return ALIASES[name] + at + revision, name
    if is_repo_id(name) and (not at or revision.strip()):
        return spec.strip(), None
    return None


def where(spec: str, *, what: str = "source", aliases: bool = True,
          local: str = "local checkpoint directory") -> Path | tuple[str, str | None]:
    """Where `spec` (SOURCE, or what `what` names: "ADAPTER") is, from its spelling and the local disk alone (no
    network, standard library only): the local directory's path when it exists, else ``(org/name[@revision],
    alias or None)`` for a Hub repo id or, with `aliases`, an alias. Anything else fails here, at once, in one line
    that names it as `what` and asks for a `local` folder or a repo id: a path that does not exist (``./x``,
    ``~/x``, ``/x``, ``a/b/c``, or ``work/x`` where ``work`` is a local folder) is a typo, never a question for the
    Hub."""
    try:
        path = Path(spec).expanduser()
        exists = path.exists()
    except (OSError, ValueError, RuntimeError) as e:  # name too long, NUL byte, ~unknown-user
        raise PrequantError(f"{what} {spec!r} is not a usable path ({e}); pass a {local}") from e
    if exists:
        return path
    why = mistyped_path(spec)
    repo = None if why else hub_spec(spec)
    if repo is not None and (aliases or repo[1] is None):
        return repo
    hint = did_you_mean(spec)
    if why:  # a path: the Hub is not asked
        raise PrequantError(f"{what} {spec!r} does not exist{hint}: {why}; pass a {local}, "
                            "or a Hub repo as org/name[@revision]")
    if not aliases:
        raise PrequantError(f"{what} {spec!r} does not exist{hint}; pass a {local}, or a Hub repo as "
                            "org/name[@revision]")
    raise PrequantError(
        f"{what} {spec!r} does not exist{hint}; pass a {local} (holding config.json and "
        f"*.safetensors weights), a Hub repo as org/name[@revision], or an alias ({', '.join(ALIASES)})"
    )


def mistyped_path(spec: str) -> str | None:
    """Why `spec`, which does not exist here, is a mistyped local path rather than a Hub repo id ("no such folder",
    or "work/ is a local folder, ..."); None when it is spelled as no path (a name, `org/name`, an alias)."""
    first = spec.strip().partition("/")[0]
    if "/" in spec and not first.startswith((".", "~")) and first not in ALIASES and _is_dir(first):
        return f"{first}/ is a local folder, so this is a path, not a Hub repo"
    if ("/" in spec or os.sep in spec or spec.startswith("~")) and hub_spec(spec) is None:
        return "no such folder"
    return None


def did_you_mean(spec: str) -> str:
    """`` (did you mean ./work/tiny?)`` when a local folder is named much like the missing `spec`, else ""."""
    try:
        guess = _close_path(Path(spec).expanduser())
    except (OSError, ValueError, RuntimeError):
        return ""
    return f" (did you mean {guess}?)" if guess else ""


def _is_dir(name: str) -> bool:
    try:
        return bool(name) and Path(name).expanduser().is_dir()
    except (OSError, ValueError, RuntimeError):
        return False


def _close_path(path: Path) -> str | None:
    """An existing folder whose name is close to the missing `path`'s, in its nearest existing parent, written as
    a path to pass (``./work/tiny``), or None."""
    parent = path.parent
    try:
        while not parent.is_dir():
            if parent == parent.parent:
                return None
            parent = parent.parent
        names = [p.name for p in parent.iterdir() if p.is_dir() and not p.name.startswith(".")]
    except OSError:
        return None
    missing = path.relative_to(parent).parts[0]  # `parent` is one of path's own parents
    close = difflib.get_close_matches(missing, names, n=1, cutoff=0.6)
    if not close:
        return None
    found = parent / close[0]
    shown = str(found)
    return shown if found.is_absolute() or shown.startswith((".", "~")) else f"./{shown}"


def local(spec: str, path: Path) -> Source:
    """The checkpoint in directory `path` (`spec`: what the user typed): which of Hugging Face's layouts it has,
    and its weight files in order."""
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


def hub(spec: str, repo_spec: str, alias: str | None, *, stream: bool) -> Source:
    """A Hub repo resolved to a commit, its small files (config, index, tokenizer, code, card) downloaded, and each
    weight shard named by the path it will have in the cache; the shards too, unless `stream` (then
    `remote_headers` plans from their headers and `hub_stream` downloads them as the conversion reaches them)."""
    from ..hub import client

    try:
        repo_id, revision = client.parse_repo_spec(repo_spec)
        listing = client.resolve(repo_id, revision, alias=alias)
    except PrequantError as e:
        # "org/name" may also have been a mistyped local path: unless the repo plainly exists (gated, or only the
        # revision is unknown), say both (the Hub cannot be reached, no such repo, offline and not cached).
        from huggingface_hub.errors import GatedRepoError, RevisionNotFoundError

        exists = isinstance(e.__cause__, (GatedRepoError, RevisionNotFoundError))
        if alias is None and not exists:
            raise e.within(f"source {spec!r} is not a local directory{did_you_mean(spec)}, and ") from e
        raise
    label = f"{alias} ({repo_id}@{listing.sha[:12]})" if alias else f"{repo_id}@{listing.sha[:12]}"
    files = listing.files
    layout = weight_layout(files)
    if layout is None:
        found = sorted(name for name in files if name.endswith(WEIGHT_SUFFIXES))
        hint = f" (found {', '.join(found[:5])})" if found else ""
        raise PrequantError(
            f"{label}: no model weights found: expected model.safetensors or model.safetensors.index.json{hint}; "
            "pass the repo of a Hugging Face checkpoint"
        )
    if CONFIG not in files:
        raise PrequantError(
            f"{label}: config.json is missing from the repo; a Hugging Face checkpoint needs one next to its weights, "
            "pick a revision that has it"
        )
    index_name, single, fmt = layout
    # Everything but weights: what a conversion copies (tokenizer, code, licence) or reads (config, index, card).
    small = [n for n in files if not n.endswith(WEIGHT_SUFFIXES) and not n.startswith(".") and "/." not in n]
    for name in sorted(small, key=lambda n: (n != CONFIG, n != index_name, n)):
        client.download(listing, name)
    root = client.cache_path(listing, CONFIG).parent
    index = root / index_name if index_name else None
    names = shard_names(f"{repo_id}@{listing.sha[:12]}", index) if index else [single]
    for name in names:
        if name not in files:
            raise PrequantError(
                f"{index_name}: shard {name!r} is listed but missing from {label}; the repo is incomplete at this "
                "revision, pick another revision"
            )
    if not stream:  # the whole checkpoint on disk, as a local directory would be
        for name in names:
            client.download(listing, name, large=True)
    return Source(
        spec, root, tuple(root / n for n in names), index, fmt,
        repo_id=repo_id, revision=revision, sha=listing.sha, hub=listing,
    )
