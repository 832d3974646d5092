"""A Hub repo resolved as SOURCE (source/spec.py), against the real local Hub server (tests/hub_server.py):
revisions pinned to their commit, a repo without config or weights, a missing path that looks like a repo, no
network, offline with and without a cache, and tokens used but never printed."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
from helpers import run_cli, run_main
from hub_repos import REPO, outputs, publish, tiny  # noqa: F401 - tiny: a fixture
from hub_server import TOKEN, HubServer

import prequant


def test_revision_is_pinned_to_its_commit(hub_server: HubServer, tiny: Path, checkpoints, tmp_path: Path) -> None:
    single = checkpoints("llama")  # same weights, one file: a different commit on branch v2
    v2 = publish(hub_server, REPO, single, revision="v2")
    hub_server.clear_log()
    prequant.convert(f"{REPO}@v2", tmp_path / "out", device="cpu", progress=False)
    source = json.loads((tmp_path / "out" / "prequant.json").read_text())["source"]
    assert (source["repo_id"], source["revision"], source["commit"]) == (REPO, "v2", v2)
    assert list(source["weight_files"]) == ["model.safetensors"]
    files = [path for method, path in hub_server.requests if "/resolve/" in path]
    assert files and all(f"/resolve/{v2}/" in path for path in files)
    prequant.convert(single, tmp_path / "local", device="cpu", progress=False)
    assert outputs(tmp_path / "out") == outputs(tmp_path / "local")


def test_unknown_revision_is_one_line(hub_server: HubServer, tiny: Path, tmp_path: Path) -> None:
    code, _, err = run_main("convert", f"{REPO}@nope", str(tmp_path / "out"), "--dry-run")
    assert code == 1 and err.count("\n") == 1 and "revision 'nope' does not exist in org/tiny" in err


@pytest.mark.parametrize(
    ("drop", "expected"),
    [
        ("config.json", "config.json is missing from the repo"),
        ("weights", "no model weights found: expected model.safetensors"),
    ],
)
def test_missing_config_or_weights_is_one_line(
    hub_server: HubServer, tiny: Path, tmp_path: Path, drop: str, expected: str
) -> None:
    files = {p.name: p for p in tiny.iterdir()}
    files = {n: p for n, p in files.items() if (n != drop if drop != "weights" else "safetensors" not in n)}
    hub_server.add_repo("org/broken", files)
    code, _, err = run_main("convert", "org/broken", str(tmp_path / "out"), "--dry-run")
    assert code == 1 and err.count("\n") == 1 and expected in err and "org/broken" in err


def test_a_missing_path_that_looks_like_a_repo_says_both(hub_server: HubServer, tmp_path: Path) -> None:
    code, _, err = run_main("convert", "models/llama", str(tmp_path / "out"), "--dry-run")
    assert code == 1 and err.count("\n") == 1
    assert "'models/llama' is not a local directory" in err and "was not found" in err


def test_a_mistyped_path_without_network_says_both(tmp_path: Path) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        endpoint = f"http://127.0.0.1:{probe.getsockname()[1]}"
    # A refused connection is retried like any passing failure (test_client.py): tried once here, for the wording.
    proc = run_cli("convert", "data/llama-8b", str(tmp_path / "out"), "--dry-run",
                   env={"HF_ENDPOINT": endpoint, "HF_HUB_OFFLINE": "0", "HF_HOME": str(tmp_path / "hf"),
                        "PREQUANT_HUB_RETRY_S": "0"})
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("Error: source 'data/llama-8b' is not a local directory, and cannot reach the "
                                  f"Hugging Face Hub at {endpoint}")


def test_grok_1_without_network_says_the_hub_cannot_be_reached(tmp_path: Path) -> None:
    with socket.socket() as probe:  # a port nobody listens on once closed: no network to reach
        probe.bind(("127.0.0.1", 0))
        endpoint = f"http://127.0.0.1:{probe.getsockname()[1]}"
    proc = run_cli("convert", "grok-1", str(tmp_path / "out"), "--dry-run",
                   env={"HF_ENDPOINT": endpoint, "HF_HUB_OFFLINE": "0", "HF_HOME": str(tmp_path / "hf"),
                        "PREQUANT_HUB_RETRY_S": "0"})
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith(f"Error: cannot reach the Hugging Face Hub at {endpoint} to resolve grok-1 "
                                  "(keyfan/grok-1-hf)")
    assert "pass its local directory" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_grok_1_offline_and_not_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    code, _, err = run_main("convert", "grok-1", str(tmp_path / "out"), "--dry-run")
    assert code == 1 and err.count("\n") == 1
    assert "grok-1 (keyfan/grok-1-hf)" in err and "HF_HUB_OFFLINE" in err and "local directory" in err


def test_offline_conversion_from_a_complete_cache(
    hub_server: HubServer, tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    prequant.convert(REPO, tmp_path / "first", device="cpu", progress=False)  # fills the cache
    hub_server.stop()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    prequant.convert(REPO, tmp_path / "second", device="cpu", progress=False)
    assert outputs(tmp_path / "second") == outputs(tmp_path / "first")


def test_hf_token_is_used_and_never_printed(
    hub_server: HubServer, tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    publish(hub_server, REPO, tiny, private=True)
    code, _, err = run_main("convert", REPO, str(tmp_path / "out"), "--dry-run")
    assert code == 1 and err.count("\n") == 1 and "HF_TOKEN" in err

    hub_server.clear_log()
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    code, out, err = run_main("convert", REPO, str(tmp_path / "out"), "--device", "cpu", "--json")
    assert code == 0, err
    assert TOKEN not in out + err
    assert all(TOKEN not in p.read_text(errors="replace") for p in (tmp_path / "out").iterdir())
    # Every request to the Hub carried it (header reads too); the CDN that LFS files redirect to never gets it.
    hub_requests = [r for r in hub_server.request_log if not r.path.startswith("/cdn-lfs/")]
    assert any("range" in r.headers for r in hub_requests) and all(r.authorized for r in hub_requests)
    assert not any(r.authorized for r in hub_server.request_log if r.path.startswith("/cdn-lfs/"))
