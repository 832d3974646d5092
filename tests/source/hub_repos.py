"""What the Hub tests of source/ share: the tiny Llama served as a repo, where the cache keeps it, its outputs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hub_server import HubServer

REPO = "org/tiny"
SHARDED = "60KB"  # the tiny llama in 4 safetensors shards


def cache_repo(repo_id: str) -> Path:
    return Path(os.environ["HF_HOME"]) / "hub" / f"models--{repo_id.replace('/', '--')}"


def publish(server: HubServer, repo_id: str, folder: Path, revision: str = "main", **kwargs) -> str:
    return server.add_repo(repo_id, {p.name: p for p in folder.iterdir() if p.is_file()}, revision, **kwargs)


def outputs(folder: Path) -> dict[str, bytes]:
    """Every output file but the two that name the source (manifest, card)."""
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.name not in ("prequant.json", "README.md")}


@pytest.fixture
def tiny(hub_server: HubServer, checkpoints) -> Path:
    """The sharded tiny llama, also served as org/tiny; returns its local directory."""
    folder = checkpoints("llama", SHARDED)
    publish(hub_server, REPO, folder)
    return folder
