"""prequant.hub.transfer (a weight shard's body, transferred by prequant) against the local Hub: the file lands where
huggingface_hub would put it, cut bodies resume from the byte they reached, a burst of 5xx is waited out."""
# ruff: noqa: F811 - test parameters named after the imported `hub_server` fixture

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
from hub_server import TOKEN, HubServer, hub_server  # noqa: F401 - the fixture

from prequant import settings
from prequant.errors import PrequantError
from prequant.hub import client as hub
from prequant.hub import transfer

REPO = "org/shards"
NAME = "model-00001-of-00001.safetensors"
SHARD = os.urandom(3 * 2**20 + 12345)


def cached(repo_id: str) -> Path:
    return Path(os.environ["HF_HOME"]) / "hub" / f"models--{repo_id.replace('/', '--')}"


def gets(server: HubServer) -> list[tuple[int | None, str | None]]:
    """(status, Range) of every GET of the shard's body (its CDN URL)."""
    return [(r.status, r.headers.get("range")) for r in server.request_log
            if r.method == "GET" and r.path.startswith("/cdn-lfs/")]  # fmt: skip


@pytest.fixture
def repo(hub_server: HubServer) -> str:
    sha = hub_server.add_repo(REPO, {"config.json": b"{}", NAME: SHARD})
    hub_server.clear_log()
    return sha


def test_the_file_lands_where_huggingface_hub_puts_it_and_it_finds_it_there(hub_server: HubServer, repo: str) -> None:
    from huggingface_hub import hf_hub_download

    path = hub.download(hub.resolve(REPO), NAME, large=True)
    assert path.read_bytes() == SHARD
    assert gets(hub_server) == [(200, None)]
    blob = cached(REPO) / "blobs" / hashlib.sha256(SHARD).hexdigest()
    assert path == cached(REPO) / "snapshots" / repo / NAME and path.is_symlink()
    assert os.readlink(path) == f"../../blobs/{blob.name}" and path.resolve() == blob
    assert not list(cached(REPO).rglob("*.incomplete"))
    # huggingface_hub takes it as its own: offline, it answers the same path without a request
    hub_server.clear_log()
    found = hf_hub_download(REPO, NAME, revision=repo, cache_dir=cached(REPO).parent, local_files_only=True)
    assert Path(found) == path and hub_server.request_log == []
    # and a second download is the cache's: no body fetched
    assert hub.download(hub.resolve(REPO), NAME, large=True) == path and gets(hub_server) == []


def test_the_token_goes_to_the_hub_and_not_to_the_cdn(hub_server: HubServer, monkeypatch: pytest.MonkeyPatch) -> None:
    sha = hub_server.add_repo("org/private", {"config.json": b"{}", NAME: SHARD}, private=True)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    hub_server.clear_log()
    assert hub.download(hub.resolve("org/private"), NAME, large=True).read_bytes() == SHARD
    to_hub = [r for r in hub_server.request_log if r.path.endswith(f"/resolve/{sha}/{NAME}")]
    to_cdn = [r for r in hub_server.request_log if r.path.startswith("/cdn-lfs/")]
    assert to_hub and all(r.authorized for r in to_hub)
    assert to_cdn and not any(r.authorized for r in to_cdn)


def test_a_cut_body_resumes_from_the_byte_it_reached(hub_server: HubServer, repo: str) -> None:
    hub_server.fail(REPO, NAME, "drop", after_bytes=100_000, times=1)
    assert hub.download(hub.resolve(REPO), NAME, large=True).read_bytes() == SHARD
    assert gets(hub_server) == [(200, None), (206, "bytes=100000-")]


def test_a_body_reset_mid_way_resumes_from_the_byte_it_reached(hub_server: HubServer, repo: str) -> None:
    """A connection reset (not a clean close): every byte that arrived before it is on disk, and the resume asks
    from there."""
    hub_server.fail(REPO, NAME, "reset", after_bytes=100_000, times=1)
    assert hub.download(hub.resolve(REPO), NAME, large=True).read_bytes() == SHARD
    assert gets(hub_server) == [(200, None), (206, "bytes=100000-")]


def test_the_metadata_request_rides_out_a_connection_reset(hub_server: HubServer, repo: str) -> None:
    hub_server.fail_request("HEAD", f"/{REPO}/resolve/{repo}/{NAME}", "reset")
    assert hub.download(hub.resolve(REPO), NAME, large=True).read_bytes() == SHARD
    heads = [r.status for r in hub_server.request_log if r.method == "HEAD"]
    assert heads == [None, 302]


def test_a_download_stopped_mid_body_is_resumed_by_the_next_one_from_the_byte_on_disk(
    hub_server: HubServer, repo: str
) -> None:
    """The partial file outlives a download that gives up (as it outlives a kill): the next download of the file
    asks only for the rest."""
    hub_server.fail(REPO, NAME, "drop", after_bytes=100_000)  # every request: no byte past it
    with pytest.raises(PrequantError):
        hub.download(hub.resolve(REPO), NAME, large=True)
    hub_server.clear_faults()
    hub_server.clear_log()
    assert hub.download(hub.resolve(REPO), NAME, large=True).read_bytes() == SHARD
    assert gets(hub_server) == [(206, "bytes=100000-")]
    assert not list(cached(REPO).rglob("*.incomplete"))


@pytest.mark.slow
def test_a_cut_whose_resume_meets_a_burst_of_503_keeps_its_bytes(
    hub_server: HubServer, repo: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(settings.HUB_RETRY_S, "20")  # waits of 1, 2 and 4 s
    hub_server.fail(REPO, NAME, "drop", after_bytes=100_000, times=1)
    hub_server.fail(REPO, NAME, "status", status=503, times=3, ranged="resume")
    assert hub.download(hub.resolve(REPO), NAME, large=True).read_bytes() == SHARD
    assert gets(hub_server) == [(200, None)] + [(503, "bytes=100000-")] * 3 + [(206, "bytes=100000-")]
    assert not list(cached(REPO).rglob("*.incomplete"))


def test_a_body_cut_at_the_same_byte_every_time_fails_in_one_line_and_leaves_nothing_that_looks_complete(
    hub_server: HubServer, repo: str
) -> None:
    hub_server.fail(REPO, NAME, "drop", after_bytes=100_000)  # every request, resumes included: no byte past it
    with pytest.raises(PrequantError) as error:
        hub.download(hub.resolve(REPO), NAME, large=True)
    message = str(error.value)
    assert "\n" not in message and f"download {NAME} of {REPO}" in message
    assert "the body stopped at byte 100000" in message
    assert "tried 4 times" in message  # the cut, then 3 resumes with no byte: the fixture's budget, waits of 1 and 2 s
    assert gets(hub_server) == [(200, None)] + [(206, "bytes=100000-")] * 3
    assert not (cached(REPO) / "snapshots" / repo / NAME).exists()
    assert not (cached(REPO) / "blobs" / hashlib.sha256(SHARD).hexdigest()).exists()
    assert [p.stat().st_size for p in cached(REPO).rglob("*.incomplete")] == [100_000]  # kept for the next download


def test_an_answer_that_is_not_retryable_fails_at_once_naming_the_file(hub_server: HubServer, repo: str) -> None:
    hub_server.fail(REPO, NAME, "status", status=404, ranged=False)
    with pytest.raises(PrequantError) as error:
        hub.download(hub.resolve(REPO), NAME, large=True)
    message = str(error.value)
    assert f"download {NAME} of {REPO}" in message and "404" in message and "tried" not in message
    assert gets(hub_server) == [(404, None)]
    assert not list(cached(REPO).rglob("*.incomplete"))


def test_a_body_that_fails_mid_read_resumes_from_what_is_on_disk(hub_server: HubServer, tmp_path: Path) -> None:
    """A timeout (or a reset) raises from inside the read loop: every byte that arrived is on disk, and the resume
    starts where the file ends, not where the request began."""
    big = os.urandom(40 * 2**20)
    hub_server.add_repo("org/big", {"config.json": b"{}", NAME: big})
    held = hub_server.fail("org/big", NAME, "hold", after_bytes=20 * 2**20, times=1, ranged=False)
    oid = hashlib.sha256(big).hexdigest()
    url = f"{hub_server.cdn_url}/cdn-lfs/{oid}?repo=org/big&file={NAME}"
    hub_server.clear_log()
    try:
        with open(tmp_path / "body", "wb", buffering=0) as out:
            transfer.fetch(url, {}, out, len(big), [1.0], label=NAME, timeout=1.0)
    finally:
        held.release.set()
    assert (tmp_path / "body").read_bytes() == big
    # the held request timed out after 20 MiB: the resume asks from there
    assert gets(hub_server) == [(200, None), (206, f"bytes={20 * 2**20}-")]


def test_a_download_stopped_by_proceed_ends_at_once_and_the_next_resumes_from_its_bytes(
    hub_server: HubServer, repo: str
) -> None:
    """`proceed` raising (the streaming reader closed) ends the download before its next read, with no retry; the
    bytes received stay on disk and the next download of the file continues from them."""

    class Stopped(Exception):
        pass

    held = hub_server.fail(REPO, NAME, "hold", after_bytes=1 << 20, times=1, ranged=False)

    def proceed() -> None:  # stops once the held request's bytes are all on disk: before a read that would wait
        if sum(p.stat().st_size for p in (cached(REPO) / "blobs").glob("*.incomplete")) >= 1 << 20:
            raise Stopped

    try:
        with pytest.raises(PrequantError) as error:
            hub.download(hub.resolve(REPO), NAME, large=True, proceed=proceed)
    finally:
        held.release.set()
    assert isinstance(error.value.__cause__, Stopped) and NAME in str(error.value)
    assert gets(hub_server) == [(200, None)]  # stopped, not retried
    assert [p.stat().st_size for p in cached(REPO).rglob("*.incomplete")] == [1 << 20]
    hub_server.clear_log()
    assert hub.download(hub.resolve(REPO), NAME, large=True).read_bytes() == SHARD
    assert gets(hub_server) == [(206, f"bytes={1 << 20}-")]
