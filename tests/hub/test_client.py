"""prequant.hub.client against a real local Hub server (tests/hub_server.py): no patching of prequant."""
# ruff: noqa: F811 - test parameters named after the imported `hub_server` fixture

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT
from hub_server import TOKEN, HubServer, hub_server  # noqa: F401 - the fixture, until conftest imports it

from prequant import settings
from prequant.errors import PrequantError, UsageError
from prequant.hub import cache
from prequant.hub import client as hub
from prequant.hub.failures import is_transient

REPO = "org/tiny"
CONFIG = b'{"model_type": "llama", "hidden_size": 8}'
SHARD_1 = os.urandom(300_000)
SHARD_2 = os.urandom(200_000)
FILES = {
    "config.json": CONFIG,
    "model-00001-of-00002.safetensors": SHARD_1,
    "model-00002-of-00002.safetensors": SHARD_2,
    "tokenizer/tokenizer.json": b'{"version": "1.0"}',
}


def cached(repo_id: str) -> Path:
    """This test's cache folder for ``repo_id`` (the fixture points HF_HOME at a tmp dir)."""
    return Path(os.environ["HF_HOME"]) / "hub" / f"models--{repo_id.replace('/', '--')}"


def one_line(error: pytest.ExceptionInfo[PrequantError]) -> str:
    message = str(error.value)
    assert "\n" not in message
    return message


@pytest.fixture
def tiny(hub_server: HubServer) -> str:
    """A public repo with two shards; returns the commit sha of main."""
    return hub_server.add_repo(REPO, FILES)


# ------------------------------------------------------------------------------------------- specs


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("org/name", ("org/name", None)),
        ("keyfan/grok-1-hf@main", ("keyfan/grok-1-hf", "main")),
        ("org/name@refs/pr/1", ("org/name", "refs/pr/1")),
        ("org/name@" + "a" * 40, ("org/name", "a" * 40)),
    ],
)
def test_parse_repo_spec(spec: str, expected: tuple[str, str | None]) -> None:
    assert hub.parse_repo_spec(spec) == expected


@pytest.mark.parametrize("spec", ["name", "a/b/c", "org/na me", "org/name@", "org/-bad-", "org/name@with space"])
def test_parse_repo_spec_rejects(spec: str) -> None:
    with pytest.raises(UsageError, match="org/name@revision"):
        hub.parse_repo_spec(spec)


# ----------------------------------------------------------------------------------------- resolve


def test_resolve_returns_sha_and_all_files_in_one_call(hub_server: HubServer, tiny: str) -> None:
    source = hub.resolve(REPO)
    assert source == hub.HubCommit(REPO, None, tiny, {path: len(data) for path, data in FILES.items()})
    assert hub_server.requests == [("GET", f"/api/models/{REPO}")]


def test_resolve_pins_a_branch(hub_server: HubServer, tiny: str) -> None:
    branch_sha = hub_server.add_repo(REPO, {"config.json": b"{}"}, revision="v2")
    source = hub.resolve(*hub.parse_repo_spec(f"{REPO}@v2"))
    assert (source.revision, source.sha, source.files) == ("v2", branch_sha, {"config.json": 2})
    assert hub.resolve(REPO).sha == tiny  # main untouched


def test_resolve_pins_an_old_commit(hub_server: HubServer, tiny: str) -> None:
    hub_server.add_repo(REPO, {"config.json": b"{}"})  # main moves on
    source = hub.resolve(*hub.parse_repo_spec(f"{REPO}@{tiny}"))
    assert source.sha == tiny
    assert set(source.files) == set(FILES)


@pytest.mark.slow
def test_resolve_rides_out_a_connection_reset_and_a_burst_of_server_errors(
    hub_server: HubServer, tiny: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The repo lookup is retried like a download: a connection reset (no answer at all), then three 503s."""
    monkeypatch.setenv(settings.HUB_RETRY_S, "20")  # waits of 1, 2, 4 and 8 s
    hub_server.fail_request("GET", f"/api/models/{REPO}", "reset")
    hub_server.fail_request("GET", f"/api/models/{REPO}", "status", status=503, times=3)
    assert hub.resolve(REPO).sha == tiny
    lookups = [r.status for r in hub_server.request_log if r.path == f"/api/models/{REPO}"]
    assert lookups == [None, 503, 503, 503, 200]  # the reset one was never answered


def test_a_lookup_that_keeps_failing_stops_in_one_line_that_says_how_long_it_tried(
    hub_server: HubServer, tiny: str
) -> None:
    hub_server.fail_request("GET", f"/api/models/{REPO}", "reset", times=None)  # the fixture's budget: 3 s
    with pytest.raises(PrequantError) as error:
        hub.resolve(REPO)
    message = one_line(error)
    assert message.startswith(f"cannot reach the Hugging Face Hub at {hub_server.url} to resolve {REPO}")
    assert "tried 3 times over 3 s" in message and settings.HUB_RETRY_S in message


def test_a_ranged_read_rides_out_a_connection_reset(hub_server: HubServer, tiny: str) -> None:
    name = "model-00001-of-00002.safetensors"
    source = hub.resolve(REPO)
    hub_server.fail_request("GET", f"/{REPO}/resolve/{tiny}/{name}", "reset", ranged=True)
    hub_server.clear_log()
    assert hub.read_range(source, name, 8, 1000) == SHARD_1[8:1000]
    resolves = [r.status for r in hub_server.request_log if r.path == f"/{REPO}/resolve/{tiny}/{name}"]
    assert resolves[0] is None and len(resolves) == 2  # reset, then asked again


def test_a_ranged_read_cut_short_by_a_reset_is_asked_again(hub_server: HubServer, tiny: str) -> None:
    name = "model-00001-of-00002.safetensors"
    source = hub.resolve(REPO)
    hub_server.fail(REPO, name, "reset", after_bytes=5000, times=1, ranged=True)
    assert hub.read_range(source, name, 0, 200_000) == SHARD_1[:200_000]


def test_a_small_files_download_rides_out_a_reset_of_its_body(hub_server: HubServer, tiny: str) -> None:
    """huggingface_hub downloads config.json, the index, the tokenizer: a reset of the body's request is retried."""
    hub_server.fail_request("GET", f"/{REPO}/resolve/{tiny}/config.json", "reset", times=2)
    assert hub.download(hub.resolve(REPO), "config.json").read_bytes() == CONFIG


def test_resolve_unknown_repo(hub_server: HubServer) -> None:
    with pytest.raises(PrequantError) as error:
        hub.resolve("org/missing")
    message = one_line(error)
    assert "org/missing was not found" in message and "HF_TOKEN" in message


def test_resolve_unknown_revision(tiny: str) -> None:
    with pytest.raises(PrequantError) as error:
        hub.resolve(REPO, "no-such-branch")
    assert "revision 'no-such-branch' does not exist in org/tiny" in one_line(error)


def test_unreachable_hub_names_endpoint_and_the_local_fix(
    hub_server: HubServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    with socket.socket() as probe:  # a port nobody listens on once closed
        probe.bind(("127.0.0.1", 0))
        endpoint = f"http://127.0.0.1:{probe.getsockname()[1]}"
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    with pytest.raises(PrequantError) as error:
        hub.resolve("keyfan/grok-1-hf", alias="grok-1")
    message = one_line(error)
    assert message.startswith(f"cannot reach the Hugging Face Hub at {endpoint} to resolve grok-1 (keyfan/grok-1-hf)")
    assert "HF_ENDPOINT" in message and "local directory" in message


# ------------------------------------------------------------------------------------------- auth


def test_private_repo_needs_a_token(hub_server: HubServer, monkeypatch: pytest.MonkeyPatch) -> None:
    hub_server.add_repo(REPO, FILES, private=True)
    with pytest.raises(PrequantError) as error:
        hub.resolve(REPO)
    message = one_line(error)
    assert "HF_TOKEN" in message and "hf auth login" in message

    hub_server.clear_log()
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    source = hub.resolve(REPO)
    path = hub.download(source, "model-00001-of-00002.safetensors")
    assert path.read_bytes() == SHARD_1
    # The token goes to the Hub, never to the CDN the LFS file is redirected to.
    cdn = [r for r in hub_server.request_log if r.path.startswith("/cdn-lfs/")]
    assert cdn and not any(r.authorized for r in cdn)
    assert all(r.authorized for r in hub_server.request_log if not r.path.startswith("/cdn-lfs/"))


@pytest.mark.parametrize("how", ["env", "argument"])
def test_rejected_token_is_never_printed(
    hub_server: HubServer, tiny: str, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    bad = "hf_ThisIsNotTheRightTokenAtAll42"
    if how == "env":
        monkeypatch.setenv("HF_TOKEN", bad)
    with pytest.raises(PrequantError) as error:
        hub.resolve(REPO, token=bad if how == "argument" else None)
    message = one_line(error)
    assert bad not in message and "401" in message and "HF_TOKEN" in message


def test_gated_repo_says_how_to_get_access(hub_server: HubServer) -> None:
    hub_server.add_repo(REPO, FILES, gated=True)
    source = hub.resolve(REPO)  # metadata of gated repos is public, files are not
    with pytest.raises(PrequantError) as error:
        hub.download(source, "config.json")
    message = one_line(error)
    assert "gated" in message and f"{hub_server.url}/{REPO}" in message and "HF_TOKEN" in message


# --------------------------------------------------------------------------------------- download


def test_download_fetches_only_that_file(hub_server: HubServer, tiny: str, tmp_path: Path) -> None:
    source = hub.resolve(REPO)
    path = hub.download(source, "model-00002-of-00002.safetensors")
    assert path.read_bytes() == SHARD_2
    assert tmp_path / "hf-home" in path.parents  # the test's HF_HOME, not the user's cache
    assert hub_server.served_files() == ["model-00002-of-00002.safetensors"]

    hub_server.clear_log()
    assert hub.download(source, "model-00002-of-00002.safetensors") == path
    assert hub_server.requests == []  # pinned to the sha: a cached file costs no request


def test_download_of_a_regular_file_in_a_subfolder(hub_server: HubServer, tiny: str) -> None:
    path = hub.download(hub.resolve(REPO), "tokenizer/tokenizer.json")
    assert path.read_bytes() == FILES["tokenizer/tokenizer.json"]
    assert ("GET", f"/{REPO}/resolve/{tiny}/tokenizer/tokenizer.json") in hub_server.requests


def test_download_of_a_file_not_in_the_repo(tiny: str) -> None:
    with pytest.raises(PrequantError) as error:
        hub.download(hub.resolve(REPO), "model-00003-of-00002.safetensors")
    assert "org/tiny has no file model-00003-of-00002.safetensors" in one_line(error)


def test_evict_removes_the_file_from_disk(tiny: str) -> None:
    source = hub.resolve(REPO)
    path = hub.download(source, "model-00001-of-00002.safetensors")
    blob = path.resolve()
    cache.evict(REPO, source.sha, "model-00001-of-00002.safetensors")
    assert not path.exists() and not path.is_symlink() and not blob.exists()
    cache.evict(REPO, source.sha, "model-00001-of-00002.safetensors")  # already gone
    cache.evict(REPO, source.sha, "config.json")  # never downloaded
    assert hub.download(source, "model-00001-of-00002.safetensors").read_bytes() == SHARD_1  # comes back


@pytest.mark.slow
def test_connection_cut_mid_file_names_the_file(hub_server: HubServer, tiny: str) -> None:
    name = "model-00001-of-00002.safetensors"
    hub_server.fail(REPO, name, "drop", after_bytes=100_000)  # every attempt, resumes included
    source = hub.resolve(REPO)
    with pytest.raises(PrequantError) as error:
        hub.download(source, name)
    assert name in one_line(error)
    cache = cached(REPO)
    assert not list(cache.rglob("*.incomplete")) and not (cache / "snapshots" / tiny / name).exists()


def test_connection_cut_once_is_resumed(hub_server: HubServer, tiny: str) -> None:
    name = "model-00001-of-00002.safetensors"
    hub_server.fail(REPO, name, "drop", after_bytes=100_000, times=1)
    path = hub.download(hub.resolve(REPO), name)
    assert path.read_bytes() == SHARD_1
    assert hub_server.served_files() == [name, name]


def test_server_error_is_retried(hub_server: HubServer, tiny: str) -> None:
    hub_server.fail(REPO, "config.json", "status", status=503, times=1)
    assert hub.download(hub.resolve(REPO), "config.json").read_bytes() == CONFIG


def test_persistent_server_error_names_the_file(hub_server: HubServer, tiny: str) -> None:
    hub_server.fail(REPO, "config.json", "status", status=500)
    with pytest.raises(PrequantError) as error:
        hub.download(hub.resolve(REPO), "config.json")
    message = one_line(error)
    assert "config.json of org/tiny" in message and "500" in message


def test_retry_waits_double_from_one_second_up_to_the_budget() -> None:
    assert hub.retry_waits(120) == [1, 2, 4, 8, 16, 30, 30, 29]  # at most 30 s apart, 2 minutes in all
    assert hub.retry_waits(3) == [1, 2]
    assert hub.retry_waits(2.5) == [1, 1.5]
    assert hub.retry_waits(0) == []  # one attempt


def _wrapped(cause: BaseException) -> BaseException:
    """`cause` as huggingface_hub's HTTP client passes it on: the cause of a connection error."""
    error = ConnectionError(f"Failed to resolve 'hub.example': {cause}")
    error.__cause__ = cause
    return error


@pytest.mark.parametrize("wrap", [lambda e: e, _wrapped], ids=["bare", "wrapped"])
def test_a_name_server_that_does_not_answer_for_now_is_retried(wrap) -> None:
    blip = socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
    assert is_transient(wrap(blip))


@pytest.mark.parametrize("wrap", [lambda e: e, _wrapped], ids=["bare", "wrapped"])
@pytest.mark.parametrize("code", [getattr(socket, n) for n in ("EAI_NONAME", "EAI_NODATA") if hasattr(socket, n)])
def test_a_host_name_that_does_not_resolve_is_not_retried(wrap, code: int) -> None:
    unknown = socket.gaierror(code, "Name or service not known")
    assert not is_transient(wrap(unknown))


@pytest.mark.slow
def test_a_cut_whose_resume_meets_a_burst_of_server_errors_is_ridden_out(
    hub_server: HubServer, tiny: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """huggingface_hub resumes a cut body, but gives up when the resume is answered 503 (and deletes what it had):
    the download is tried again, waiting longer each time, until the burst is over."""
    name = "model-00001-of-00002.safetensors"
    monkeypatch.setenv(settings.HUB_RETRY_S, "20")
    hub_server.fail(REPO, name, "drop", after_bytes=100_000, times=1)
    hub_server.fail(REPO, name, "status", status=503, times=3)
    hub_server.clear_log()
    path = hub.download(hub.resolve(REPO), name)
    assert path.read_bytes() == SHARD_1
    bodies = [(r.status, "range" in r.headers) for r in hub_server.request_log
              if r.method == "GET" and r.path.startswith("/cdn-lfs/")]
    # cut at 100 kB, its resume refused, two more refusals, then the whole file
    # cut at 100 kB; huggingface_hub's resume (from 0: it had written none of the 100 kB, its 10 MB chunk was not
    # full) refused, two more attempts refused, then the whole file
    assert bodies == [(200, False), (503, False), (503, False), (503, False), (200, False)]
    assert not list(cached(REPO).rglob("*.incomplete"))


def test_a_resume_from_mid_file_refused_with_503_starts_the_file_again(
    hub_server: HubServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shard larger than huggingface_hub's 10 MB write chunk, cut after 12 MB: it resumes from the 10 MB it wrote
    (a ranged request), which a Hub in trouble answers 503; that download fails and deletes its partial file, and
    the next attempt fetches the whole file."""
    big = os.urandom(24 * 2**20)
    name = "model-00001-of-00001.safetensors"
    hub_server.add_repo("org/big", {"config.json": CONFIG, name: big})
    monkeypatch.setenv(settings.HUB_RETRY_S, "20")
    hub_server.fail("org/big", name, "drop", after_bytes=12 * 2**20, times=1, ranged=False)
    hub_server.fail("org/big", name, "status", status=503, times=1, ranged=True, min_start=2**20)
    hub_server.clear_log()
    assert hub.download(hub.resolve("org/big"), name).read_bytes() == big
    bodies = [(r.status, r.headers.get("range")) for r in hub_server.request_log
              if r.method == "GET" and r.path.startswith("/cdn-lfs/")]
    assert bodies == [(200, None), (503, f"bytes={10 * 2**20}-"), (200, None)]
    assert not list(cached("org/big").rglob("*.incomplete"))


def test_an_outage_longer_than_the_retries_says_how_long_it_tried(hub_server: HubServer, tiny: str) -> None:
    hub_server.fail(REPO, "config.json", "status", status=503)  # the fixture's budget: 3 s
    with pytest.raises(PrequantError) as error:
        hub.download(hub.resolve(REPO), "config.json")
    message = one_line(error)
    assert "config.json of org/tiny" in message and "503" in message
    assert "tried 3 times over 3 s" in message and settings.HUB_RETRY_S in message


def _partial(repo_id: str, etag: str) -> Path:
    """A partial download as huggingface_hub names it (blobs/<etag>.<8 hex>.incomplete)."""
    blobs = cached(repo_id) / "blobs"
    blobs.mkdir(parents=True, exist_ok=True)
    partial = blobs / f"{etag}.0badf00d.incomplete"
    partial.write_bytes(b"x" * 1000)
    return partial


def test_a_partial_download_left_by_a_killed_process_is_removed(hub_server: HubServer, tiny: str) -> None:
    stale = _partial(REPO, "ab" * 32)
    hub.download(hub.resolve(REPO), "config.json")
    assert not stale.exists()


def test_a_resumable_partial_download_of_older_huggingface_hub_stays(hub_server: HubServer, tiny: str) -> None:
    """huggingface_hub before 2.4 wrote <etag>.incomplete and resumed it on the next download: it is kept."""
    blobs = cached(REPO) / "blobs"
    blobs.mkdir(parents=True, exist_ok=True)
    resumable = blobs / f"{'ef' * 32}.incomplete"
    resumable.write_bytes(b"x" * 1000)
    assert cache.remove_stale_partials(REPO) == []
    assert resumable.exists()


def test_a_partial_download_another_process_is_writing_stays(hub_server: HubServer, tiny: str) -> None:
    etag = "cd" * 32
    writing = _partial(REPO, etag)
    lock = Path(os.environ["HF_HOME"]) / "hub" / ".locks" / cached(REPO).name / f"{etag}.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    holder = subprocess.Popen(  # holds the lock as huggingface_hub's download would, until its stdin closes
        [sys.executable, "-c", "import sys; from filelock import FileLock\n"
         "with FileLock(sys.argv[1]):\n    print('held', flush=True); sys.stdin.read()", str(lock)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        assert cache.remove_stale_partials(REPO) == []
        assert writing.exists()
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    assert cache.remove_stale_partials(REPO) == [writing.name]  # its writer is gone: stale now
    assert not writing.exists()


def test_file_of_the_wrong_size_is_never_kept(hub_server: HubServer, tiny: str) -> None:
    listed = hub.resolve(REPO)
    wrong = hub.HubCommit(REPO, None, tiny, {**listed.files, "config.json": len(CONFIG) + 1})
    with pytest.raises(PrequantError) as error:
        hub.download(wrong, "config.json")
    message = one_line(error)
    assert "config.json of org/tiny" in message and "incomplete" in message
    assert not (cached(REPO) / "snapshots" / tiny / "config.json").exists()


# ---------------------------------------------------------------------------------------- offline


def test_offline_resolves_and_downloads_from_the_cache(
    hub_server: HubServer, tiny: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    online = hub.resolve(REPO)
    hub.download(online, "config.json")
    hub_server.stop()  # nothing may reach the network now
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    offline = hub.resolve(REPO)
    assert offline == online  # full listing, although only config.json was downloaded
    assert hub.download(offline, "config.json").read_bytes() == CONFIG
    with pytest.raises(PrequantError) as error:
        hub.download(offline, "model-00001-of-00002.safetensors")
    assert "model-00001-of-00002.safetensors" in one_line(error)


def test_offline_without_a_cached_snapshot(tiny: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(PrequantError) as error:
        hub.resolve(REPO)
    message = one_line(error)
    assert "org/tiny" in message and "HF_HUB_OFFLINE" in message and "local directory" in message


def test_a_subprocess_sees_the_server(hub_server: HubServer, tiny: str) -> None:
    """CLI tests run `python -m prequant` in a subprocess: the fixture's environment must reach it."""
    code = "from prequant.hub import client as hub; s = hub.resolve('org/tiny'); print(s.sha, hub.download(s, 'config.json'))"
    root = ROOT
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=root,
        env=os.environ.copy(),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    sha, path = result.stdout.split()
    assert sha == tiny and Path(path).read_bytes() == CONFIG
