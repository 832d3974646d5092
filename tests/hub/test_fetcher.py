"""prequant.hub.fetcher: downloads in a child process, against the real local Hub server (no patching)."""
# ruff: noqa: F811 - test parameters named after the imported `hub_server` fixture

from __future__ import annotations

import os
import signal

import pytest
from hub_server import TOKEN, HubServer, hub_server  # noqa: F401 - the fixture, until conftest imports it

from prequant.errors import PrequantError
from prequant.hub import client
from prequant.hub.fetcher import Fetcher

REPO = "org/fetched"
SHARD_1 = os.urandom(300_000)
SHARD_2 = os.urandom(200_000)
FILES = {
    "config.json": b'{"model_type": "llama", "hidden_size": 8}',
    "model-00001-of-00002.safetensors": SHARD_1,
    "model-00002-of-00002.safetensors": SHARD_2,
}


def test_each_download_runs_in_one_child_which_ends_on_close(hub_server: HubServer) -> None:
    hub_server.add_repo(REPO, FILES)
    fetcher = Fetcher(client.resolve(REPO))
    first = fetcher.download("model-00001-of-00002.safetensors")
    child = fetcher._proc
    assert child is not None and child.pid != os.getpid() and child.poll() is None
    second = fetcher.download("model-00002-of-00002.safetensors")
    assert fetcher._proc is child  # one child for every download
    assert first.path.read_bytes() == SHARD_1 and second.path.read_bytes() == SHARD_2
    assert first.path == client.cache_path(client.resolve(REPO), "model-00001-of-00002.safetensors")
    assert first.fresh and second.fresh  # this fetcher put them in the cache
    assert sorted(hub_server.served_files()) == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    fetcher.close()
    assert child.returncode == 0  # it saw its stdin close and ended by itself


def test_the_childs_errors_are_the_in_process_errors(hub_server: HubServer) -> None:
    """Same type, same one line: a gated file, and a file the commit does not have."""
    hub_server.add_repo(REPO, FILES, gated=True)
    source = client.resolve(REPO)
    fetcher = Fetcher(source)
    try:
        for name in ("config.json", "model-00003-of-00002.safetensors"):
            with pytest.raises(PrequantError) as here:
                client.download(source, name)
            with pytest.raises(PrequantError) as there:
                fetcher.download(name)
            assert type(there.value) is type(here.value) and str(there.value) == str(here.value)
            assert "\n" not in str(there.value)
    finally:
        fetcher.close()


def test_the_token_in_the_environment_reaches_the_child(hub_server: HubServer, monkeypatch: pytest.MonkeyPatch) -> None:
    hub_server.add_repo(REPO, FILES, private=True)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    fetcher = Fetcher(client.resolve(REPO))
    try:
        assert fetcher.download("model-00002-of-00002.safetensors").path.read_bytes() == SHARD_2
    finally:
        fetcher.close()


def test_a_child_that_died_is_an_error_naming_the_file(hub_server: HubServer) -> None:
    hub_server.add_repo(REPO, FILES)
    fetcher = Fetcher(client.resolve(REPO))
    fetcher.download("config.json")
    assert fetcher._proc is not None
    fetcher._proc.send_signal(signal.SIGKILL)
    fetcher._proc.wait()
    with pytest.raises(PrequantError) as error:
        fetcher.download("model-00001-of-00002.safetensors")
    message = str(error.value)
    assert "model-00001-of-00002.safetensors of org/fetched" in message and "run the command again" in message
    fetcher.close()


def test_no_download_starts_after_close(hub_server: HubServer) -> None:
    """A download asked for after the conversion closed its reader neither runs here nor leaves a child behind."""
    hub_server.add_repo(REPO, FILES)
    fetcher = Fetcher(client.resolve(REPO))
    fetcher.download("config.json")
    fetcher.close()
    hub_server.clear_log()
    with pytest.raises(PrequantError, match="were stopped"):
        fetcher.download("model-00001-of-00002.safetensors")
    assert fetcher._proc is None and hub_server.requests == []


def test_a_file_already_in_the_cache_is_not_fresh(hub_server: HubServer) -> None:
    hub_server.add_repo(REPO, FILES)
    source = client.resolve(REPO)
    client.download(source, "model-00001-of-00002.safetensors")  # the user's, from before
    fetcher = Fetcher(source)
    try:
        assert not fetcher.download("model-00001-of-00002.safetensors").fresh
        assert fetcher.download("model-00002-of-00002.safetensors").fresh
    finally:
        fetcher.close()


def test_a_begun_download_is_answered_to_the_download_of_that_file(hub_server: HubServer) -> None:
    hub_server.add_repo(REPO, FILES)
    fetcher = Fetcher(client.resolve(REPO))
    try:
        fetcher.begin("model-00001-of-00002.safetensors")
        # another file asked for first: the begun one's answer is kept for its own download, still fresh
        assert fetcher.download("model-00002-of-00002.safetensors").path.read_bytes() == SHARD_2
        begun = fetcher.download("model-00001-of-00002.safetensors")
        assert begun.path.read_bytes() == SHARD_1 and begun.fresh
        assert sorted(hub_server.served_files()) == ["model-00001-of-00002.safetensors",
                                                     "model-00002-of-00002.safetensors"]  # each once
    finally:
        fetcher.close()
