"""What a SOURCE is once resolved (`Source`) and what it holds (`Contents`), and how a SOURCE string names a Hub
repo or an alias."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

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


def hub_spec(spec: str) -> tuple[str, str | None] | None:
    """``(org/name[@revision], alias or None)`` when `spec` names a Hub repo or an alias, else None."""
    name, at, revision = spec.strip().partition("@")
    if name in ALIASES:
        return ALIASES[name] + at + revision, name
    if name.count("/") == 1 and not name.startswith((".", "/", "~")) and not name.endswith("/"):
        return spec.strip(), None
    return None
