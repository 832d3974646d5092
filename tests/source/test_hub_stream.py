"""A Hub repo's shards streamed as SOURCE, against the real local Hub server (tests/hub_server.py): planned from
ranged header reads, downloaded one by one as the conversion reaches them (two at a time, within the two-shard
bound), deleted after use on request, through resets, cuts, 5xx and kills; Grok-1's `.bin` shards. Resolving the
repo (revisions, missing files, offline, tokens) is test_hub_repo.py's."""

from __future__ import annotations

import hashlib
import signal
import json
import os
import shutil
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from helpers import run_cli, run_main, start_cli
from hub_repos import REPO, cache_repo, outputs, publish, tiny  # noqa: F401 - tiny: a fixture
from hub_server import HubServer

import prequant
from prequant import settings
from prequant.hub import cache as hub_cache
from prequant.hub import client as hub
from prequant.source import hub_stream, remote_headers
from prequant.source import resolve as sources
from prequant.errors import PrequantError


def _serves(record, name: str) -> bool:
    """Whether `record` is a GET that answers with file `name`'s bytes (or an error in their place): the CDN
    request of an LFS file, or its resolve request when it is not a redirect to the CDN."""
    if record.method != "GET" or record.status == 302:
        return False
    if record.path.startswith("/cdn-lfs/"):
        return record.query.get("file") == [name]
    return "/resolve/" in record.path and record.path.split("/resolve/", 1)[1].split("/", 1)[1] == name


def shard_requests(server: HubServer) -> list[tuple[str, bool]]:
    """(file name, ranged) of every GET that sent a weight file's bytes, in order (resolve or CDN)."""
    found = []
    for record in server.request_log:
        if record.method != "GET" or record.status not in (200, 206):
            continue
        if record.path.startswith("/cdn-lfs/"):
            name = record.query["file"][0]
        elif "/resolve/" in record.path:
            name = record.path.split("/resolve/", 1)[1].split("/", 1)[1]
        else:
            continue
        if name.endswith((".safetensors", ".bin")):
            found.append((name, "range" in record.headers))
    return found


# ------------------------------------------------------------------------------------------ converting


def test_hub_conversion_is_byte_identical_to_the_local_one(hub_server: HubServer, tiny: Path, tmp_path: Path) -> None:
    sha = hub_server.head(REPO)
    summary = prequant.convert(REPO, tmp_path / "hub", device="cpu", progress=False)
    prequant.convert(tiny, tmp_path / "local", device="cpu", progress=False)
    assert outputs(tmp_path / "hub") == outputs(tmp_path / "local")
    assert summary.source == f"{REPO}@{sha}"

    source = json.loads((tmp_path / "hub" / "prequant.json").read_text())["source"]
    assert (source["repo_id"], source["revision"], source["commit"]) == (REPO, None, sha)
    assert source["weight_files"] == {p.name: p.stat().st_size for p in tiny.glob("*.safetensors")}
    assert f"base_model: {REPO}" in (tmp_path / "hub" / "README.md").read_text()
    # Without --delete-source-shards the downloads stay in the cache.
    snapshot = cache_repo(REPO) / "snapshots" / sha
    assert sorted(p.name for p in snapshot.glob("*.safetensors")) == sorted(p.name for p in tiny.glob("*.safetensors"))


def test_plan_reads_headers_by_range_then_downloads_each_shard_once(
    hub_server: HubServer, tiny: Path, tmp_path: Path
) -> None:
    plan = prequant.convert(REPO, tmp_path / "unused", dry_run=True)
    planned = shard_requests(hub_server)
    assert planned and all(ranged for _, ranged in planned)  # planning downloads no shard
    assert not (cache_repo(REPO) / "blobs").exists() or not any(
        p.stat().st_size > 10_000 for p in (cache_repo(REPO) / "blobs").iterdir()
    )
    assert not (tmp_path / "unused").exists()  # a dry run writes nothing

    hub_server.clear_log()
    prequant.convert(REPO, tmp_path / "out", device="cpu", progress=False, delete_source_shards=True)
    fetched = shard_requests(hub_server)
    ranged = [i for i, (_, r) in enumerate(fetched) if r]
    whole = [name for name, r in fetched if not r]
    assert ranged and max(ranged) < min(i for i, (_, r) in enumerate(fetched) if not r)  # headers first
    order = list(dict.fromkeys(step.source.file.name for step in plan.steps))
    assert sorted(whole) == sorted(order)  # each shard once (two download at once: they may arrive out of order)


def _disk_sampler(repo_id: str, shard_sizes: dict[str, int]):
    """Measure this repo's weight shards taking disk space in the cache, for real: blobs present (partial
    downloads too) plus deleted blobs this process still holds open or mapped. Returns (sample, peaks)."""
    blobs = cache_repo(repo_id) / "blobs"
    peaks = {"shards": 0, "bytes": 0, "downloading": 0}

    def sample() -> None:
        present: set[str] = set()
        downloading = 0
        try:
            names = os.listdir(blobs)
        except FileNotFoundError:
            names = []
        for name in names:
            blob = name.split(".", 1)[0]  # a partial download is <etag>.<8 hex>.incomplete (huggingface_hub 2.4)
            if blob in shard_sizes:
                present.add(blob)
                downloading += name.endswith(".incomplete")
        held = [line.rsplit(" ", 2)[-2] for line in Path("/proc/self/maps").read_text().splitlines()
                if line.endswith(" (deleted)")]
        for fd in os.listdir("/proc/self/fd"):
            try:
                held.append(os.readlink(f"/proc/self/fd/{fd}").removesuffix(" (deleted)"))
            except OSError:
                continue
        present |= {Path(p).name for p in held if p.startswith(str(blobs)) and Path(p).name in shard_sizes
                    and not (blobs / Path(p).name).exists()}
        peaks["shards"] = max(peaks["shards"], len(present))
        peaks["bytes"] = max(peaks["bytes"], sum(shard_sizes[b] for b in present))
        peaks["downloading"] = max(peaks["downloading"], downloading)

    return sample, peaks


def _convert_sampling(sample, tiny: Path, tmp_path: Path) -> None:
    """Convert REPO with --delete-source-shards into tmp_path/out while a thread calls `sample()` over and over;
    check its bytes against the local conversion of `tiny`."""
    stop = threading.Event()

    def keep_sampling() -> None:
        while not stop.is_set():
            sample()

    sampler = threading.Thread(target=keep_sampling, daemon=True)
    sampler.start()
    try:
        prequant.convert(REPO, tmp_path / "out", device="cpu", progress=False, delete_source_shards=True)
    finally:
        stop.set()
        sampler.join()
    prequant.convert(tiny, tmp_path / "local", device="cpu", progress=False)
    assert outputs(tmp_path / "out") == outputs(tmp_path / "local")


def test_delete_source_shards_keeps_at_most_two_on_disk(
    hub_server: HubServer, tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shards = {hashlib.sha256(p.read_bytes()).hexdigest(): p.stat().st_size for p in tiny.glob("*.safetensors")}
    assert len(shards) == 4
    sample, peaks = _disk_sampler(REPO, shards)
    # Sample at the moments that matter (a download just finished; a tensor just written) and continuously.
    real_download, real_tensor_done = hub.download, hub_stream.HubShardReader.tensor_done

    def download(*args, **kwargs):
        path = real_download(*args, **kwargs)
        sample()
        return path

    def tensor_done(self, ref):
        sample()
        real_tensor_done(self, ref)
        sample()

    monkeypatch.setattr(hub, "download", download)
    monkeypatch.setattr(hub_stream.HubShardReader, "tensor_done", tensor_done)
    _convert_sampling(sample, tiny, tmp_path)
    two_largest = sum(sorted(shards.values())[-2:])
    assert 1 <= peaks["shards"] <= 2 and peaks["bytes"] <= two_largest
    assert peaks["downloading"] <= 2  # two download at once, and their partial files count as shards on disk
    assert not [p for p in (cache_repo(REPO) / "blobs").iterdir() if p.name in shards]  # all deleted at the end
    snapshot = cache_repo(REPO) / "snapshots" / hub_server.head(REPO)
    assert (snapshot / "config.json").is_file() and not list(snapshot.glob("*.safetensors"))


def _wait_for(condition) -> None:
    """Poll until `condition()` holds, with no deadline (no guessed time limit): each condition is a state that
    must come, or one that can no longer change (e.g. the awaited thread died), which the caller then checks."""
    while not condition():
        time.sleep(0.01)


def _blocked_in(thread: threading.Thread, function: str) -> bool:
    """Whether `thread` is, right now, inside a call of `function` (a name in its current stack)."""
    frame = sys._current_frames().get(thread.ident)
    while frame is not None:
        if frame.f_code.co_name == function:
            return True
        frame = frame.f_back
    return False


def _streamed(tmp_path: Path):
    """The plan of REPO, its source shards in reading order, and a streaming reader with --delete-source-shards."""
    plan = prequant.convert(REPO, tmp_path / "unused", dry_run=True)
    files = list(dict.fromkeys(step.source.file for step in plan.steps))
    data = sources.reader(sources.resolve(REPO, stream=True), [step.source for step in plan.steps], delete=True)
    return plan, files, data


def _finish_shard(data, plan, file: Path) -> None:
    """Every tensor of one source shard written: the reader evicts it."""
    for step in plan.steps:
        if step.source.file == file:
            data.tensor_done(step.source)


def _all_waiting_for_room(data) -> bool:
    """Whether every download thread of `data` is inside its wait for room (or has ended)."""
    return all(_blocked_in(t, "wait_for_room") or not t.is_alive() for t in data._threads)


def test_next_shard_is_prefetched_and_a_third_waits_for_a_deletion(
    hub_server: HubServer, tiny: Path, tmp_path: Path
) -> None:
    plan, files, data = _streamed(tmp_path)
    assert len(files) == 4
    try:
        data.prepare(files[0])
        assert files[0].is_file()
        downloaders = data._threads  # started by that first prepare
        assert len(downloaders) == hub_stream.DOWNLOADS
        _wait_for(lambda: len(data.downloaded) == 2 or not any(t.is_alive() for t in downloaders))
        assert sorted(data.downloaded) == sorted(f.name for f in files[:2])  # the next one, with nobody asking
        data.prepare(files[1])  # downloaded; now also checked against the plan
        # The download threads' next move is to wait for room for the third: once they are all inside that wait,
        # with two shards on disk, only a deletion (or close) can let one go on. No time is guessed.
        _wait_for(lambda: _all_waiting_for_room(data))
        assert any(t.is_alive() for t in downloaders), "the download threads finished instead of waiting for room"
        assert sorted(data.downloaded) == sorted(f.name for f in files[:2])  # two on disk: the third waits
        assert not files[2].exists()
        whole = [name for name, ranged in shard_requests(hub_server) if not ranged]
        assert sorted(whole) == sorted(f.name for f in files[:2])  # the server never got a request for the third's
        _finish_shard(data, plan, files[0])
        assert not files[0].exists() and data.evicted == [files[0].name]
        # The deletion made room: the third comes unasked (threads that died instead fail here, no hang).
        _wait_for(lambda: len(data.downloaded) == 3 or not any(t.is_alive() for t in downloaders))
        assert data.downloaded[2] == files[2].name
        data.prepare(files[2])
        assert files[2].is_file()
    finally:
        data.close()


@pytest.mark.slow
def test_two_shards_download_at_once_within_the_two_shard_bound(
    hub_server: HubServer, tiny: Path, tmp_path: Path
) -> None:
    plan, files, data = _streamed(tmp_path)
    held = hub_server.fail(REPO, files[0].name, "hold", after_bytes=10_000, times=1, ranged=False)
    try:
        data.start()
        assert held.arrived.wait(120)  # the first shard's body is half sent, and stays so
        _wait_for(lambda: files[1].name in data.downloaded or not any(t.is_alive() for t in data._threads))
        assert data.downloaded == [files[1].name]  # the second came meanwhile: two downloads at once
        _wait_for(lambda: _all_waiting_for_room(data) or files[0].name in data.downloaded)
        with data._cond:  # one downloading (counted whole), one downloaded
            assert data.scratch.held() == sum((tiny / f.name).stat().st_size for f in files[:2])  # no third yet
        assert not files[2].exists()
    finally:
        held.release.set()
    try:
        _wait_for(lambda: files[0].name in data.downloaded or not any(t.is_alive() for t in data._threads))
        data.prepare(files[0])
        assert files[0].read_bytes() == (tiny / files[0].name).read_bytes()
    finally:
        data.close()


def test_closing_the_reader_stops_a_download_mid_body_and_keeps_its_bytes(
    hub_server: HubServer, tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """close() ends a download in flight at its next read (here the resume once the held read times out): the
    download thread ends without the rest of the shard, whose bytes so far stay for the next run to resume."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_DOWNLOAD_TIMEOUT", 1)  # the held read gives up after 1 s, not 10
    _, files, data = _streamed(tmp_path)
    held = hub_server.fail(REPO, files[0].name, "hold", after_bytes=10_000, times=1, ranged=False)
    etag = hashlib.sha256((tiny / files[0].name).read_bytes()).hexdigest()  # an LFS file's: its sha256
    partial = hub_cache.blobs_folder(REPO) / f"{etag}.incomplete"

    def on_disk() -> int:
        return partial.stat().st_size if partial.exists() else 0

    try:
        data.start()
        # The first shard's body is cut short, and stays so: every byte sent is on disk, the read waits for more.
        _wait_for(lambda: on_disk() == 10_000 or not any(t.is_alive() for t in data._threads))
        data.close()
        for thread in data._threads:
            thread.join()  # no deadline: a download that went on regardless would end with the whole shard
    finally:
        held.release.set()
    assert files[0].name not in data.downloaded and not files[0].exists()
    assert on_disk() == 10_000


def test_an_evicted_shard_still_open_keeps_its_slot_until_closed(
    hub_server: HubServer, tiny: Path, tmp_path: Path
) -> None:
    # A deleted file's space is freed only when its last descriptor or mapping goes: until then it is one of the
    # two shards on disk, and the next download waits (it used to count mappings only, and not at all between
    # taking the shard off the downloaded ones and deleting it).
    plan, files, data = _streamed(tmp_path)
    try:
        data.prepare(files[0])
        downloaders = data._threads
        data.prepare(files[1])
        _wait_for(lambda: _all_waiting_for_room(data))
        held = os.open(files[0], os.O_RDONLY)  # e.g. a library caller's handle, or a view's descriptor
        try:
            _finish_shard(data, plan, files[0])
            assert not files[0].exists() and data.evicted == [files[0].name]
            assert os.fstat(held).st_blocks > 0  # deleted, but its blocks still allocated
            with data._cond:  # the download threads' own count, as they decide
                two = sum((tiny / f.name).stat().st_size for f in files[:2])  # the evicted one's too
                assert (data.scratch.held(), data.scratch.downloading) == (two, set())  # no download in flight
            assert sorted(data.downloaded) == sorted(f.name for f in files[:2]) and not files[2].exists()
        finally:
            os.close(held)
        # freed: the third comes
        _wait_for(lambda: len(data.downloaded) == 3 or not any(t.is_alive() for t in downloaders))
        assert data.downloaded[2] == files[2].name
    finally:
        data.close()


def test_killed_hub_conversion_resumes_without_downloading_finished_shards(
    hub_server: HubServer, tiny: Path, tmp_path: Path
) -> None:
    plan = prequant.convert(REPO, tmp_path / "unused", dry_run=True)
    order = list(dict.fromkeys(step.source.file.name for step in plan.steps))
    first = sum(step.source.file.name == order[0] for step in plan.steps)
    out = tmp_path / "out"
    killed = run_cli("convert", REPO, str(out), "--device", "cpu", "--delete-source-shards",
                     env={"PREQUANT_FAILPOINT": f"step-journaled:{first + 1}"})  # SIGKILL after shard 1 is done
    assert killed.returncode == -9, killed.stderr
    hub_server.clear_log()
    prequant.convert(REPO, out, device="cpu", progress=False, resume=True, delete_source_shards=True)
    prequant.convert(tiny, tmp_path / "local", device="cpu", progress=False)
    assert outputs(out) == outputs(tmp_path / "local")
    downloaded = [name for name, ranged in shard_requests(hub_server) if not ranged]
    assert order[0] not in downloaded and downloaded  # finished before the kill: only its header is read again


def test_only_shards_this_run_downloaded_are_deleted(hub_server: HubServer, tiny: Path, tmp_path: Path) -> None:
    listing = hub.resolve(REPO)
    kept = next(name for name in listing.files if name.endswith(".safetensors"))
    hub.download(listing, kept)  # in the cache before the run: the user's, not prequant's
    prequant.convert(REPO, tmp_path / "out", device="cpu", progress=False, delete_source_shards=True)
    snapshot = cache_repo(REPO) / "snapshots" / listing.sha
    assert [p.name for p in snapshot.glob("*.safetensors")] == [kept]


def test_delete_source_shards_refused_for_a_local_directory(tiny: Path, tmp_path: Path) -> None:
    before = sorted(p.name for p in tiny.iterdir())
    code, _, err = run_main("convert", str(tiny), str(tmp_path / "out"), "--device", "cpu", "--delete-source-shards")
    assert code == 2 and "only applies to a Hub source" in err and "never deletes" in err
    assert sorted(p.name for p in tiny.iterdir()) == before


def test_header_read_is_retried_after_a_server_error(hub_server: HubServer, tiny: Path, tmp_path: Path) -> None:
    first = sorted(p.name for p in tiny.glob("*.safetensors"))[0]
    hub_server.fail(REPO, first, status=503, times=1, ranged=True)
    hub_server.clear_log()
    plan = prequant.convert(REPO, tmp_path / "unused", dry_run=True)
    requests = [r for r in hub_server.request_log if _serves(r, first)]
    assert [(r.status, "range" in r.headers) for r in requests] == [(503, True), (206, True)]  # refused, retried
    assert plan.input_bytes == sum(p.stat().st_size for p in tiny.glob("*.safetensors")) - sum(
        8 + int.from_bytes(p.read_bytes()[:8], "little") for p in tiny.glob("*.safetensors"))


def test_header_read_that_keeps_failing_names_the_file(hub_server: HubServer, tiny: Path, tmp_path: Path) -> None:
    first = sorted(p.name for p in tiny.glob("*.safetensors"))[0]
    hub_server.fail(REPO, first, status=500, ranged=True)
    with pytest.raises(PrequantError) as error:
        prequant.convert(REPO, tmp_path / "unused", dry_run=True)
    message = str(error.value)
    assert f"read {first} of {REPO}" in message and "500" in message and "\n" not in message


def test_failed_download_stops_the_conversion_with_the_file_named(
    hub_server: HubServer, tiny: Path, tmp_path: Path
) -> None:
    plan = prequant.convert(REPO, tmp_path / "unused", dry_run=True)
    third = list(dict.fromkeys(step.source.file.name for step in plan.steps))[2]
    # The headers read fine (ranged requests); then the third shard's download (a whole-file GET) fails.
    hub_server.fail(REPO, third, status=404, ranged=False)
    hub_server.clear_log()
    with pytest.raises(PrequantError) as error:
        prequant.convert(REPO, tmp_path / "out", device="cpu", progress=False, delete_source_shards=True)
    assert third in str(error.value) and "\n" not in str(error.value)
    assert not (tmp_path / "out" / "config.json").exists()
    # The fault hit what it was meant to, and nothing else: the third's header was read, its download refused.
    requests = [r for r in hub_server.request_log if _serves(r, third)]
    assert any("range" in r.headers and r.status == 206 for r in requests)
    assert [r.status for r in requests if "range" not in r.headers] == [404]


def test_a_failure_elsewhere_never_leaves_the_reader_waiting(
    hub_server: HubServer, tiny: Path, tmp_path: Path
) -> None:
    """A NaN in the last shard fails the quantizer while the reader may be waiting for room to download."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "nan"
    shutil.copytree(tiny, folder)
    plan = prequant.convert(folder, tmp_path / "unused", dry_run=True)
    step = next(s for s in reversed(plan.steps) if s.quantize)
    shard = folder / step.source.file.name
    tensors = load_file(shard)
    tensors[step.source.name][0, 0] = float("nan")
    save_file(tensors, shard, metadata={"format": "pt"})
    publish(hub_server, REPO, folder)
    result: list[BaseException] = []

    def run() -> None:
        try:
            prequant.convert(REPO, tmp_path / "out", device="cpu", progress=False, delete_source_shards=True)
        except BaseException as e:  # noqa: BLE001
            result.append(e)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join()  # no deadline: a reader left waiting would hang the test here
    assert len(result) == 1
    assert isinstance(result[0], PrequantError) and step.source.name in str(result[0])
    assert "\n" not in str(result[0])
    # Every pipeline stage was joined before the error came back: nothing is left waiting for a download.
    stages = {"prequant-read_all", "prequant-write_all"}
    assert not [t.name for t in threading.enumerate() if t.name in stages and t.is_alive()]


# ------------------------------------------------------------------------------- a Hub that fails mid-shard


def _shard_order(tmp_path: Path) -> list[str]:
    plan = prequant.convert(REPO, tmp_path / "unused", dry_run=True)
    return list(dict.fromkeys(step.source.file.name for step in plan.steps))


def _bodies(server: HubServer, name: str) -> list[int]:
    """The status of every whole-file GET that answered with `name`'s bytes (or an error in their place)."""
    return [r.status for r in server.request_log if _serves(r, name) and "range" not in r.headers]


def _gets(server: HubServer, name: str) -> list[tuple[int | None, str | None]]:
    """(status, Range) of every GET for `name`'s bytes to its end (whole or resumed; not the header reads)."""
    return [(r.status, r.headers.get("range")) for r in server.request_log if _serves(r, name) and r.to_the_end]


@pytest.mark.slow
def test_a_conversion_rides_out_a_reset_of_every_kind_of_request_and_a_burst_of_503s_on_the_lookup(
    hub_server: HubServer, tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One connection reset on the repo lookup, then three 503s; one on a small file's download, on a shard's
    metadata request, on a shard's ranged header read, and on a shard's body mid-way: the conversion goes on, to the
    bytes of the local conversion, each body resumed from the byte it reached."""
    monkeypatch.setenv(settings.HUB_RETRY_S, "20")  # the lookup's four failures: waits of 1, 2, 4 and 8 s
    sha = hub_server.head(REPO)
    first, second = sorted(p.name for p in tiny.glob("*.safetensors"))[:2]
    lookup = f"/api/models/{REPO}"
    hub_server.fail_request("GET", lookup, "reset")
    hub_server.fail_request("GET", lookup, "status", status=503, times=3)
    hub_server.fail_request("GET", f"/{REPO}/resolve/{sha}/config.json", "reset")
    hub_server.fail_request("GET", f"/{REPO}/resolve/{sha}/{first}", "reset", ranged=True)  # its header read
    hub_server.fail_request("HEAD", f"/{REPO}/resolve/{sha}/{second}", "reset")  # its metadata, before its body
    hub_server.fail(REPO, second, "reset", after_bytes=10_000, times=1, ranged=False)
    hub_server.clear_log()
    prequant.convert(REPO, tmp_path / "hub", device="cpu", progress=False, delete_source_shards=True)
    prequant.convert(tiny, tmp_path / "local", device="cpu", progress=False)
    assert outputs(tmp_path / "hub") == outputs(tmp_path / "local")
    assert [r.status for r in hub_server.request_log if r.path == lookup] == [None, 503, 503, 503, 200]
    resets = {(r.method, r.path.rsplit("/", 1)[-1], "range" in r.headers) for r in hub_server.request_log
              if r.status is None}
    assert resets == {("GET", REPO.split("/")[1], False), ("GET", "config.json", False), ("GET", first, True),
                      ("HEAD", second, False)}  # every fault hit (the body's reset came after its 200)
    assert _gets(hub_server, second) == [(200, None), (206, "bytes=10000-")]
    assert not list(cache_repo(REPO).rglob("*.incomplete"))


@pytest.mark.slow
def test_a_shard_cut_mid_body_then_refused_with_5xx_converts_to_the_same_bytes(
    hub_server: HubServer, tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    second = _shard_order(tmp_path)[1]
    monkeypatch.setenv(settings.HUB_RETRY_S, "20")  # long enough for the burst: waits of 1, 2 and 4 s
    hub_server.fail(REPO, second, "drop", after_bytes=10_000, times=1, ranged=False)
    hub_server.fail(REPO, second, "status", status=503, times=3, ranged="resume")
    hub_server.clear_log()
    prequant.convert(REPO, tmp_path / "hub", device="cpu", progress=False, delete_source_shards=True)
    prequant.convert(tiny, tmp_path / "local", device="cpu", progress=False)
    assert outputs(tmp_path / "hub") == outputs(tmp_path / "local")
    # cut at 10 kB; its resume from there refused three times, then the rest: the 10 kB are not fetched again
    assert _gets(hub_server, second) == [(200, None)] + [(503, "bytes=10000-")] * 3 + [(206, "bytes=10000-")]
    assert not list(cache_repo(REPO).rglob("*.incomplete"))


@pytest.mark.slow
def test_an_outage_longer_than_the_retries_stops_in_one_line_and_resume_finishes(
    hub_server: HubServer, tiny: Path, tmp_path: Path
) -> None:
    order = _shard_order(tmp_path)
    third = order[2]
    outage = hub_server.fail(REPO, third, "status", status=503, ranged=False)  # the fixture's budget: 3 s
    out = tmp_path / "out"
    failed = run_cli("convert", REPO, str(out), "--device", "cpu", "--delete-source-shards")
    lines = failed.stderr.strip().splitlines()
    assert failed.returncode == 1 and len([line for line in lines if line.startswith("Error:")]) == 1, failed.stderr
    error = next(line for line in lines if line.startswith("Error:"))
    assert f"download {third} of {REPO}" in error and "503" in error and "tried 3 times" in error
    assert "run the same command again" in error and "--resume" not in error
    assert not (out / "config.json").exists()  # nothing that looks like a checkpoint

    hub_server.clear_faults()  # the Hub is back
    assert outage in hub_server._made
    hub_server.clear_log()
    resumed = run_cli("convert", REPO, str(out), "--device", "cpu", "--delete-source-shards", "--resume")
    assert resumed.returncode == 0, resumed.stderr
    prequant.convert(tiny, tmp_path / "local", device="cpu", progress=False)
    assert outputs(out) == outputs(tmp_path / "local")
    downloaded = [name for name, ranged in shard_requests(hub_server) if not ranged]
    # The first two shards' tensors were kept: not downloaded again; nor the fourth if it came while the third
    # failed (the journal says the failed run downloaded it: the resume converts it, then deletes it).
    assert third in downloaded and set(downloaded) <= set(order[2:]) and len(downloaded) == len(set(downloaded))
    assert not list(cache_repo(REPO).glob("snapshots/*/*.safetensors"))  # every download deleted once converted


def test_a_conversion_killed_mid_download_resumes_the_shard_from_the_bytes_on_disk(
    hub_server: HubServer, tiny: Path, tmp_path: Path
) -> None:
    """SIGKILL while a shard's body is half sent: the bytes that arrived are on disk, in the partial file the next
    download of that shard continues; the resumed run asks only for the rest, and converts to the same bytes."""
    second = _shard_order(tmp_path)[1]
    held = hub_server.fail(REPO, second, "hold", after_bytes=10_000, times=1, ranged=False)
    out = tmp_path / "out"
    proc = start_cli("convert", REPO, str(out), "--device", "cpu", "--delete-source-shards")
    try:
        assert held.arrived.wait(120), "the second shard's download never started"
        blobs = cache_repo(REPO) / "blobs"
        _wait_for(lambda: proc.poll() is not None or _partial_size(second, tiny) == 10_000)
        proc.kill()
        proc.wait(timeout=60)
    finally:
        held.release.set()
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -9
    assert _partial_size(second, tiny) == 10_000  # what the kill left

    hub_server.clear_log()
    resumed = run_cli("convert", REPO, str(out), "--device", "cpu", "--delete-source-shards", "--resume")
    assert resumed.returncode == 0, resumed.stderr
    prequant.convert(tiny, tmp_path / "local", device="cpu", progress=False)
    assert outputs(out) == outputs(tmp_path / "local")
    assert _gets(hub_server, second) == [(206, "bytes=10000-")]  # the rest of it, not the whole shard again
    assert not [p.name for p in blobs.iterdir() if p.name.endswith(".incomplete")]


def test_shards_a_killed_run_downloaded_are_deleted_by_its_resume(
    hub_server: HubServer, tiny: Path, tmp_path: Path
) -> None:
    """Killed with its first shard downloaded and not yet converted: that shard is in the cache when --resume
    starts, yet it is the interrupted run's download (its journal says so), not the user's: deleted once converted."""
    order = _shard_order(tmp_path)
    out = tmp_path / "out"
    # Frozen (SIGSTOP) as its first tensor is journaled: the first shard is downloaded, not all its tensors written.
    proc = start_cli("convert", REPO, str(out), "--device", "cpu", "--delete-source-shards",
                     env={"PREQUANT_FAILPOINT": "step-journaled:1:SIGSTOP"})
    try:
        _wait_for(lambda: proc.poll() is not None or _stopped(proc.pid))
        assert list(cache_repo(REPO).glob(f"snapshots/*/{order[0]}"))  # downloaded, still in the cache
        proc.kill()
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    resumed = run_cli("convert", REPO, str(out), "--device", "cpu", "--delete-source-shards", "--resume")
    assert resumed.returncode == 0, resumed.stderr
    prequant.convert(tiny, tmp_path / "local", device="cpu", progress=False)
    assert outputs(out) == outputs(tmp_path / "local")
    assert not list(cache_repo(REPO).glob("snapshots/*/*.safetensors"))  # the killed run's download too


def test_a_shard_whose_blob_a_killed_run_finished_but_never_linked_is_deleted_by_its_resume(
    hub_server: HubServer, tiny: Path, tmp_path: Path
) -> None:
    """Killed between a download's last byte (the blob in place) and its snapshot link: the blob is the killed run's
    (its journal says so), not the user's, though the resume finds it in the cache: deleted once converted."""
    etags = {hashlib.sha256(p.read_bytes()).hexdigest() for p in tiny.glob("*.safetensors")}
    repo, out = cache_repo(REPO), tmp_path / "out"
    _killed_at("blob-downloaded", out)
    assert [p for p in (repo / "blobs").iterdir() if p.name in etags]  # a whole shard, no link to it
    assert not list(repo.glob("snapshots/*/*.safetensors"))
    _resume_leaves_no_shard(tiny, out, tmp_path, etags)


def _killed_at(failpoint: str, out: Path) -> None:
    """Convert REPO with --delete-source-shards into `out`, SIGKILLed at the first hit of `failpoint`."""
    killed = run_cli("convert", REPO, str(out), "--device", "cpu", "--delete-source-shards",
                     env={"PREQUANT_FAILPOINT": f"{failpoint}:1"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr


def _resume_leaves_no_shard(tiny: Path, out: Path, tmp_path: Path, etags: set[str]) -> None:
    """--resume finishes `out` with the local conversion's bytes and leaves no shard (blob or link) in the cache."""
    repo = cache_repo(REPO)
    resumed = run_cli("convert", REPO, str(out), "--device", "cpu", "--delete-source-shards", "--resume")
    assert resumed.returncode == 0, resumed.stderr
    prequant.convert(tiny, tmp_path / "local", device="cpu", progress=False)
    assert outputs(out) == outputs(tmp_path / "local")
    assert not [p for p in (repo / "blobs").iterdir() if p.name.split(".", 1)[0] in etags]
    assert not list(repo.glob("snapshots/*/*.safetensors"))


def _stopped(pid: int) -> bool:
    """Whether process `pid` is stopped (SIGSTOP), from /proc."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"
    except OSError:
        return False


def test_downloads_start_when_asked_before_any_read(hub_server: HubServer, tiny: Path, tmp_path: Path) -> None:
    src = sources.resolve(REPO, stream=True)
    tensors = sources.scan(src)
    data = sources.reader(src, tensors)
    try:
        data.start()  # what convert() does once the tensors are known, before the layout and the plan
        assert data._threads  # started, with nothing read
        first = _shard_order(tmp_path)[0]
        _wait_for(lambda: first in data.downloaded or not any(t.is_alive() for t in data._threads))
        assert first in data.downloaded  # no tensor was read: the download did not wait for one
    finally:
        data.close()


# ------------------------------------------------------------------------------------ grok-1 and .bin


@pytest.fixture(scope="module")
def grok_bin(tmp_path_factory) -> Path:
    from helpers import build_grok

    return build_grok(tmp_path_factory.mktemp("grok") / "grok-1-hf", "keyfan", shards=3)


def test_alias_grok_1_plans_bin_shards_from_their_pickles(
    hub_server: HubServer, grok_bin: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(remote_headers, "BLOCK", 4096)  # tiny shards: smaller reads, to see that data is skipped
    sha = publish(hub_server, "keyfan/grok-1-hf", grok_bin)
    code, out, err = run_main("convert", "grok-1", str(tmp_path / "out"), "--dry-run", "--json")
    assert code == 0, err
    local = prequant.convert(grok_bin, tmp_path / "unused", dry_run=True)
    assert json.loads(out) == local.to_dict()
    fetched = shard_requests(hub_server)
    assert fetched and all(ranged for _, ranged in fetched)  # zip directory and pickle only
    sizes = {p.name: p.stat().st_size for p in grok_bin.glob("*.bin")}
    ranged_bytes = sum(
        int(r.headers["range"].split("-")[1]) - int(r.headers["range"].split("=")[1].split("-")[0]) + 1
        for r in hub_server.request_log if r.method == "GET" and "range" in r.headers
        and not r.path.startswith("/cdn-lfs/")
    )
    assert ranged_bytes < sum(sizes.values()) / 2
    assert sha in {p.name for p in (cache_repo("keyfan/grok-1-hf") / "snapshots").iterdir()}


def test_grok_bin_shards_stream_and_match_the_local_conversion(
    hub_server: HubServer, grok_bin: Path, tmp_path: Path
) -> None:
    publish(hub_server, "keyfan/grok-1-hf", grok_bin)
    prequant.convert("grok-1", tmp_path / "hub", device="cpu", progress=False, delete_source_shards=True)
    prequant.convert(grok_bin, tmp_path / "local", device="cpu", progress=False)
    assert outputs(tmp_path / "hub") == outputs(tmp_path / "local")
    assert not list(cache_repo("keyfan/grok-1-hf").rglob("*.bin"))  # every shard deleted once converted
    source = json.loads((tmp_path / "hub" / "prequant.json").read_text())["source"]
    assert source["repo_id"] == "keyfan/grok-1-hf" and source["spec"] == "grok-1"


def test_malicious_pickle_on_the_hub_is_refused_while_planning(
    hub_server: HubServer, grok_bin: Path, tmp_path: Path
) -> None:
    from helpers import Evil

    folder = tmp_path / "evil"
    shutil.copytree(grok_bin, folder)
    shard = min(folder.glob("*.bin"))
    marker = tmp_path / "pwned"
    torch.save({**torch.load(shard, weights_only=True), "evil": Evil(marker)}, shard)
    publish(hub_server, "org/evil", folder)
    with pytest.raises(PrequantError, match="refused to unpickle") as error:
        prequant.convert("org/evil", tmp_path / "out", dry_run=True)
    assert shard.name in str(error.value) and "org/evil" in str(error.value)
    assert not marker.exists()
    assert not list(cache_repo("org/evil").rglob("*.bin"))  # refused from its pickle, never downloaded


def _partial_size(name: str, tiny: Path) -> int | None:
    """The size of shard `name`'s partial download in the cache, None if there is none."""
    etag = hashlib.sha256((tiny / name).read_bytes()).hexdigest()
    found = list((cache_repo(REPO) / "blobs").glob(f"{etag}*.incomplete"))
    return found[0].stat().st_size if found else None


def test_a_shard_is_deleted_right_after_its_last_tensor_and_not_before(
    hub_server: HubServer, tiny: Path, tmp_path: Path
) -> None:
    """With delete, the first shard stays in the cache, whole, until its last tensor is written, and the third
    waits for room meanwhile; right after its last tensor it is deleted and the third downloads, in one request."""
    plan, files, data = _streamed(tmp_path)
    first = [step.source for step in plan.steps if step.source.file == files[0]]
    assert len(first) >= 2
    try:
        data.prepare(files[0])
        data.prepare(files[1])
        blob = files[0].resolve()
        for ref in first[:-1]:  # all but its last tensor
            data.view(ref)  # read, as the pipeline reads it
            data.tensor_done(ref)
            _wait_for(lambda: _all_waiting_for_room(data))
            assert files[0].read_bytes() == (tiny / files[0].name).read_bytes() and data.evicted == []
            assert not files[2].exists() and files[2].name not in data.downloaded
        data.tensor_done(first[-1])  # its last: deleted at once
        assert not files[0].exists() and not blob.exists() and data.evicted == [files[0].name]
        _wait_for(lambda: files[2].name in data.downloaded or not any(t.is_alive() for t in data._threads))
        data.prepare(files[2])
        assert files[2].read_bytes() == (tiny / files[2].name).read_bytes()
        assert shard_requests(hub_server).count((files[2].name, False)) == 1
    finally:
        data.close()


def test_deleted_shards_convert_to_the_same_bytes_within_the_budget(
    hub_server: HubServer, tiny: Path, tmp_path: Path
) -> None:
    """A whole conversion deleting its shards as it goes: the local conversion's bytes; the disk the shards really
    take (blocks allocated, partial downloads and shards held open after leaving the cache included) stays within
    the budget; nothing left in the cache."""
    sizes = [p.stat().st_size for p in tiny.glob("*.safetensors")]
    etags = {hashlib.sha256(p.read_bytes()).hexdigest() for p in tiny.glob("*.safetensors")}
    blobs = cache_repo(REPO) / "blobs"
    peak = [0]

    def allocated() -> int:
        files = {}  # inode -> blocks allocated: each file once, whatever names or descriptors reach it
        for name in os.listdir(blobs) if blobs.is_dir() else []:
            if name.split(".", 1)[0] not in etags:  # config.json and the other small files are not shards
                continue
            try:
                st = os.lstat(blobs / name)
            except FileNotFoundError:
                continue
            files[st.st_ino] = st.st_blocks * 512
        for fd in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
                if target.startswith(str(blobs)) and target.endswith(" (deleted)"):
                    st = os.stat(f"/proc/self/fd/{fd}")
                    files[st.st_ino] = st.st_blocks * 512
            except OSError:
                continue
        return sum(files.values())

    def sample() -> None:
        peak[0] = max(peak[0], allocated())

    _convert_sampling(sample, tiny, tmp_path)
    # The budget counts bytes; the disk allocates blocks: each shard file in play (at most the 4) may take one
    # partial block more than its bytes.
    block = os.statvfs(blobs).f_frsize
    assert 0 < peak[0] <= 2 * max(sizes) + len(sizes) * block
    assert not [p for p in blobs.iterdir() if p.name.split(".", 1)[0] in etags]  # every shard gone, partials too


def test_a_run_killed_mid_shard_leaves_nothing_that_looks_complete_and_resumes(
    hub_server: HubServer, tiny: Path, tmp_path: Path
) -> None:
    """Frozen, then SIGKILLed, after its second tensor is journaled: the shard it was converting is still in the
    cache, whole, and so is every shard blob left; --resume converts to the local bytes and deletes them."""
    etags = {hashlib.sha256(p.read_bytes()).hexdigest(): p.read_bytes() for p in tiny.glob("*.safetensors")}
    blobs = cache_repo(REPO) / "blobs"
    out = tmp_path / "out"
    proc = start_cli("convert", REPO, str(out), "--device", "cpu", "--delete-source-shards",
                     env={"PREQUANT_FAILPOINT": "step-journaled:2:SIGSTOP"})
    try:
        _wait_for(lambda: proc.poll() is not None or _stopped(proc.pid))
        assert proc.poll() is None, proc.communicate()[1]
        assert [p for p in blobs.iterdir() if p.name in etags]  # the shard being converted, at least
        for blob in blobs.iterdir():  # what the cache holds under a shard's etag is that shard, whole
            if blob.name in etags:
                assert blob.read_bytes() == etags[blob.name]
        for link in cache_repo(REPO).glob("snapshots/*/*.safetensors"):  # a whole shard, or one being evicted
            assert link.resolve().name in etags and (link.resolve().is_file() or not link.exists())
        proc.kill()
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    resumed = run_cli("convert", REPO, str(out), "--device", "cpu", "--delete-source-shards", "--resume")
    assert resumed.returncode == 0, resumed.stderr
    prequant.convert(tiny, tmp_path / "local", device="cpu", progress=False)
    assert outputs(out) == outputs(tmp_path / "local")
    assert not [p for p in blobs.iterdir() if p.name.split(".", 1)[0] in etags]  # the killed run's shards too
    assert not list(cache_repo(REPO).glob("snapshots/*/*.safetensors"))  # and their links


def test_a_run_killed_mid_eviction_leaves_no_blob_behind_and_its_resume_removes_the_link(
    hub_server: HubServer, tiny: Path, tmp_path: Path
) -> None:
    """Killed between deleting a converted shard's blob and its snapshot link: no blob that no link names (a
    shard's worth of disk no run would find again) is left; the resume removes the dangling link and finishes."""
    etags = {hashlib.sha256(p.read_bytes()).hexdigest() for p in tiny.glob("*.safetensors")}
    repo, out = cache_repo(REPO), tmp_path / "out"
    _killed_at("blob-evicted", out)
    links = list(repo.glob("snapshots/*/*.safetensors"))
    dangling = [link for link in links if not link.exists()]
    assert len(dangling) == 1
    for blob in (repo / "blobs").iterdir():  # every blob left is a shard some link still names
        if blob.name in etags:
            assert any(link.resolve() == blob for link in links)
    _resume_leaves_no_shard(tiny, out, tmp_path, etags)
