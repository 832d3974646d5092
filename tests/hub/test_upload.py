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
