"""prequant.hub.upload against a real local Hub server (tests/hub_server.py): no patching of prequant."""
# ruff: noqa: F811 - test parameters named after the imported `hub_server` fixture

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hub_server import TOKEN, HubServer, hub_server  # noqa: F401 - the fixture, until conftest imports it

from prequant.errors import PrequantError
from prequant.hub.upload import upload


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    folder = tmp_path / "out"
    folder.mkdir()
    (folder / "config.json").write_text('{"quantization_config": {"quant_method": "bitsandbytes"}}')
    (folder / "README.md").write_text("---\nlibrary_name: transformers\n---\n# tiny, 4-bit\n")
    (folder / "model.safetensors").write_bytes(os.urandom(11 * 1024 * 1024))  # over the Hub's 10 MB LFS limit
    return folder


@pytest.mark.parametrize("client", ["lfs", "xet-inline"])
def test_upload_arrives_byte_for_byte(
    hub_server: HubServer, checkpoint: Path, monkeypatch: pytest.MonkeyPatch, client: str
) -> None:
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    if client == "xet-inline":  # huggingface_hub's default streamed pipeline; the server keeps it off Xet storage
        from huggingface_hub import constants

        monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", False)
        hub_server.upload_mode = "regular"

    url = upload(checkpoint, "me/tiny-bnb-4bit", commit_message="first").commit_url
    first = hub_server.head("me/tiny-bnb-4bit")
    assert url == f"{hub_server.url}/me/tiny-bnb-4bit/commit/{first}"
    uploaded = hub_server.files("me/tiny-bnb-4bit")
    assert {path: uploaded[path] for path in uploaded if path != ".gitattributes"} == {
        p.name: p.read_bytes() for p in checkpoint.iterdir()
    }
    used_lfs = any(path.startswith("/lfs-upload/") for _, path in hub_server.requests)
    assert used_lfs == (client == "lfs")

    (checkpoint / "config.json").write_text('{"changed": true}')
    second_url = upload(checkpoint, "me/tiny-bnb-4bit", commit_message="second").commit_url
    assert second_url != url
    assert [c.message for c in hub_server.commits("me/tiny-bnb-4bit")][:2] == ["second", "first"]
    assert hub_server.files("me/tiny-bnb-4bit")["config.json"] == b'{"changed": true}'


@pytest.mark.parametrize("how", ["argument", "spec"])
def test_upload_to_a_new_branch(
    hub_server: HubServer, checkpoint: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    (checkpoint / "model.safetensors").unlink()  # keep it small
    if how == "argument":
        upload(checkpoint, "me/tiny", revision="nf4", private=True)
    else:
        upload(checkpoint, "me/tiny@nf4", private=True)
    assert "config.json" in hub_server.files("me/tiny", "nf4")
    assert set(hub_server.files("me/tiny")) == {".gitattributes"}  # main untouched


def test_upload_without_a_token(hub_server: HubServer, checkpoint: Path) -> None:
    with pytest.raises(PrequantError) as error:
        upload(checkpoint, "me/tiny")
    message = str(error.value)
    assert "\n" not in message and "me/tiny" in message and "HF_TOKEN" in message
    assert not hub_server.has_repo("me/tiny")


def test_upload_offline(checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(PrequantError, match="HF_HUB_OFFLINE"):
        upload(checkpoint, "me/tiny")


# ------------------------------------------------------------------------------------- subprocess


# ----------------------------------------------------------------------------- visibility and passing failures

REPO = "me/tiny-bnb-4bit"
LOOKUP = f"/api/models/{REPO}"


def _uploaded(server: HubServer, folder: Path, repo_id: str = REPO) -> dict[str, bytes]:
    return {path: data for path, data in server.files(repo_id).items() if path != ".gitattributes"}


def _writes(server: HubServer) -> list[tuple[str, str]]:
    """Every request that sends content or changes a repo."""
    return [(m, p) for m, p in server.requests if m in ("PUT", "POST") and not p.endswith("/paths-info/main")]


@pytest.mark.parametrize("times", [1, None], ids=["one-503", "503-throughout"])
def test_private_into_a_public_repo_is_refused_whatever_the_lookup_answers_first(
    hub_server: HubServer, checkpoint: Path, monkeypatch: pytest.MonkeyPatch, times: int | None
) -> None:
    """A 503 on the lookup is retried, never read as "no such repo": the public repo is refused (or, while the
    Hub never answers, the upload is), and nothing is written into it."""
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    before = hub_server.add_repo(REPO, {"README.md": b"public"}, private=False)
    hub_server.fail_request("GET", LOOKUP, "status", status=503, times=times)
    with pytest.raises(PrequantError) as error:
        upload(checkpoint, REPO, private=True)
    message = str(error.value)
    assert "\n" not in message and REPO in message
    if times == 1:
        assert "it exists and is public" in message
    else:
        assert "look up" in message and "503" in message and "tried" in message
    assert hub_server.head(REPO) == before and hub_server.files(REPO) == {"README.md": b"public"}
    assert _writes(hub_server) == []


def test_a_new_private_repo_is_said_private(
    hub_server: HubServer, checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    hub_server.fail_request("GET", LOOKUP, "status", status=503, times=1)
    assert upload(checkpoint, REPO, private=True).private is True
    assert hub_server._find(REPO).private


WRITES = {
    "create": ("POST", "/api/repos/create"),
    "preupload": ("POST", f"/api/models/{REPO}/preupload/main"),
    "lfs-batch": ("POST", f"/{REPO}.git/info/lfs/objects/batch"),
    "object": ("PUT", "/lfs-upload/*"),
    "commit": ("POST", f"/api/models/{REPO}/commit/main"),
}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["status", "reset"])
@pytest.mark.parametrize("call", list(WRITES))
def test_each_write_call_is_retried(
    hub_server: HubServer, checkpoint: Path, monkeypatch: pytest.MonkeyPatch, call: str, kind: str
) -> None:
    """A burst of failures on any call of the write side (lookup excepted: above) is ridden out; the upload ends as
    an uninterrupted one does: one commit with every file."""
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setenv("PREQUANT_HUB_RETRY_S", "10")
    method, path = WRITES[call]
    fault = hub_server.fail_request(method, path, kind, status=503, times=2)
    upload(checkpoint, REPO, commit_message="one")
    assert fault.times == 0  # both failures were met
    assert _uploaded(hub_server, checkpoint) == {p.name: p.read_bytes() for p in checkpoint.iterdir()}
    assert [c.message for c in hub_server.commits(REPO)] == ["one", "initial commit"]


@pytest.mark.parametrize("status", [500, 502, 504])
def test_a_commit_that_landed_although_its_answer_failed_is_not_made_twice(
    hub_server: HubServer, checkpoint: Path, monkeypatch: pytest.MonkeyPatch, status: int
) -> None:
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    hub_server.add_repo(REPO, {"README.md": b"old"})
    hub_server.fail_request("POST", WRITES["commit"][1], "applied", status=status, times=1)
    url = upload(checkpoint, REPO, commit_message="new").commit_url
    commits = hub_server.commits(REPO)
    assert [c.message for c in commits] == ["new", "Add files"]  # once, on the old head
    assert url.endswith(commits[0].sha)
    assert _uploaded(hub_server, checkpoint) == {p.name: p.read_bytes() for p in checkpoint.iterdir()}
    assert hub_server.requests.count(("POST", WRITES["commit"][1])) == 1  # the branch was read, not re-sent


def test_a_failing_xet_service_is_named(hub_server: HubServer, checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With Xet on and a Hub that has no Xet service, the error says Xet and how to upload without it (it used to
    read as a network failure)."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", False)
    with pytest.raises(PrequantError) as error:
        upload(checkpoint, REPO)
    message = str(error.value)
    assert "\n" not in message and "Xet" in message and "HF_HUB_DISABLE_XET=1" in message
    assert "check the network" not in message
