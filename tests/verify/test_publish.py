"""Publishing: upload to a (local) Hub gated on verify, convert --push-to-hub, the CI workflow."""
# ruff: noqa: F811 - test parameters named after the imported `hub_server` fixture

from __future__ import annotations

import json
import shlex
import shutil
import time
from pathlib import Path

import pytest
import yaml
from helpers import ROOT, run_cli, run_main, start_cli
from hub_server import TOKEN, HubServer, hub_server  # noqa: F401 - the fixture
from huggingface_hub import ModelCard

WORKFLOW = ROOT / ".github" / "workflows" / "publish-quantized.yml"


@pytest.fixture
def out(carded_converted, tmp_path) -> Path:
    return Path(shutil.copytree(carded_converted, tmp_path / "tiny-llama-nf4"))


@pytest.fixture
def logged_in(hub_server: HubServer, monkeypatch) -> HubServer:
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    return hub_server


# ---------------------------------------------------------------------------------------- upload


def test_upload_arrives_byte_for_byte_and_card_parses(logged_in: HubServer, out: Path, tmp_path):
    code, stdout, stderr = run_main("upload", str(out), "me/tiny-nf4", "--commit-message", "first", "--json")
    assert code == 0, stderr
    result = json.loads(stdout)
    assert result["verified"] is True and result["commit_url"].endswith(logged_in.head("me/tiny-nf4"))
    uploaded = logged_in.files("me/tiny-nf4")
    local = {p.name: p.read_bytes() for p in out.iterdir()}
    assert {k: v for k, v in uploaded.items() if k != ".gitattributes"} == local
    assert sorted(result["files"]) == sorted(local)
    (tmp_path / "card.md").write_bytes(uploaded["README.md"])
    card = ModelCard.load(tmp_path / "card.md")
    assert card.data.license_name == "tiny-licence"
    assert card.data.base_model is None  # a local folder names no Hub repo: the card links none
    assert logged_in.commits("me/tiny-nf4")[0].message == "first"


def test_failed_verification_blocks_upload(logged_in: HubServer, out: Path):
    shard = out / "model.safetensors"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(data)
    code, _, stderr = run_main("upload", str(out), "me/tiny-nf4")
    assert code == 1
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: refusing to upload") and "model.safetensors" in lines[0]
    assert logged_in.requests == [] and not logged_in.has_repo("me/tiny-nf4")


def test_files_outside_the_conversion_block_upload(logged_in: HubServer, out: Path):
    (out / ".env").write_text("SECRET=1")
    code, _, stderr = run_main("upload", str(out), "me/tiny-nf4")
    assert code == 1 and ".env" in stderr and "not part of the conversion" in stderr
    assert logged_in.requests == []


def test_upload_to_a_branch_privately(logged_in: HubServer, out: Path):
    code, stdout, stderr = run_main("upload", str(out), "me/tiny", "--revision", "nf4", "--private", "--json")
    assert code == 0, stderr
    assert json.loads(stdout)["revision"] == "nf4"
    assert "prequant.json" in logged_in.files("me/tiny", "nf4")


def test_upload_into_an_existing_repo_replaces_the_old_checkpoint(logged_in: HubServer, out: Path):
    """An earlier conversion there had three shards and an index; this one has a single file. Loaders take a
    leftover index or shard over the new ones: the commit removes them, and nothing else of the repo."""
    logged_in.add_repo("me/tiny-nf4", {
        "model-00001-of-00003.safetensors": b"old shard 1", "model-00002-of-00003.safetensors": b"old shard 2",
        "model-00003-of-00003.safetensors": b"old shard 3", "model.safetensors.index.json": b"{}",
        "pytorch_model.bin": b"older still", "config.json": b"{}", "eval/results.json": b"{}",
        "NOTES.md": b"the owner's notes", "old/model.safetensors": b"kept: not where a loader looks",
    })
    code, stdout, stderr = run_main("upload", str(out), "me/tiny-nf4", "--json")
    assert code == 0, stderr
    uploaded = logged_in.files("me/tiny-nf4")
    assert set(uploaded) == {p.name for p in out.iterdir()} | {"eval/results.json", "NOTES.md", "old/model.safetensors"}
    assert all(uploaded[p.name] == p.read_bytes() for p in out.iterdir())
    assert json.loads(stdout)["deleted"] == [
        "model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors", "model-00003-of-00003.safetensors",
        "model.safetensors.index.json", "pytorch_model.bin",
    ]
    assert len(logged_in.commits("me/tiny-nf4")) == 2  # one commit: the files and the deletions together


def test_private_into_an_existing_public_repo_is_refused(logged_in: HubServer, out: Path):
    logged_in.add_repo("me/public", {"README.md": b"public"}, private=False)
    before = logged_in.head("me/public")
    code, stdout, stderr = run_main("upload", str(out), "me/public", "--private", "--json")
    assert code == 1 and stdout == ""
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "refusing to upload to me/public: it exists and is public" in lines[0], stderr
    assert logged_in.head("me/public") == before and logged_in.files("me/public") == {"README.md": b"public"}


def test_the_result_says_the_repos_actual_visibility(logged_in: HubServer, out: Path):
    logged_in.add_repo("me/secret", {"README.md": b"private"}, private=True)
    code, stdout, stderr = run_main("upload", str(out), "me/secret", "--json")  # no --private: it stays private
    assert code == 0, stderr
    assert json.loads(stdout)["private"] is True


def test_convert_push_to_hub(logged_in: HubServer, carded_source: Path, tmp_path):
    proc = run_cli("convert", str(carded_source), str(tmp_path / "out"), "--device", "cpu", "--push-to-hub", "me/pushed",
                   "--json")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["hub_commit_url"].endswith(logged_in.head("me/pushed"))
    uploaded = logged_in.files("me/pushed")
    assert uploaded["prequant.json"] == (tmp_path / "out" / "prequant.json").read_bytes()
    assert b'from_pretrained("me/pushed"' in uploaded["README.md"]  # the card names the repo it lives in


def test_private_with_a_503_on_the_lookup_is_refused_and_the_public_repo_unchanged(logged_in: HubServer, out: Path):
    """One 503 on the repo's lookup used to read as "no such repo": the upload then went into the public repo."""
    logged_in.add_repo("me/public", {"README.md": b"public"}, private=False)
    before = logged_in.head("me/public")
    logged_in.fail_request("GET", "/api/models/me/public", "status", status=503, times=1)
    code, stdout, stderr = run_main("upload", str(out), "me/public", "--private", "--json")
    assert code == 1 and stdout == ""
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "refusing to upload to me/public: it exists and is public" in lines[0], stderr
    assert logged_in.head("me/public") == before and logged_in.files("me/public") == {"README.md": b"public"}
    assert not [r for r in logged_in.requests if r[0] in ("PUT", "POST")]


def test_upload_progress_is_reported_like_the_conversions(logged_in: HubServer, out: Path, monkeypatch):
    monkeypatch.setenv("PREQUANT_PROGRESS", "json")
    code, _, stderr = run_main("upload", str(out), "me/tiny-nf4")
    assert code == 0, stderr
    records = [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]
    done = [r for r in records if r["task"] == "uploading" and r["event"] == "done"]
    assert len(done) == 1 and done[0]["done_bytes"] == done[0]["total_bytes"] == sum(
        p.stat().st_size for p in out.iterdir())


# ---------------------------------------------------------------------------------- convert --push-to-hub

PUSHED = "me/pushed"
UPLOAD = "/lfs-upload/*"


def _object_uploads(server: HubServer) -> list[str]:
    """The oid of every object body sent (PUT /lfs-upload/<oid>), in order."""
    return [path.rsplit("/", 1)[1] for method, path in server.requests if (method, path[:12]) == ("PUT", "/lfs-upload/")]


def _assert_published(server: HubServer, out: Path) -> None:
    """The repo holds the output as it is on disk, committed once; no commit ever showed config.json before every
    shard (each commit is a state a reader polling the revision could see)."""
    local = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and not p.name.startswith(".")}
    assert {k: v for k, v in server.files(PUSHED).items() if k != ".gitattributes"} == local
    commits = server.commits(PUSHED)
    assert [c.message for c in commits][1:] == ["initial commit"]
    shards = {name for name in local if name.endswith(".safetensors")}
    for commit in commits:
        assert "config.json" not in commit.files or shards <= set(commit.files)


def test_push_uploads_shards_while_converting(logged_in: HubServer, checkpoints, tmp_path: Path):
    """The first shard's object goes up before the last shard is written: the source's last shard (a Hub source,
    downloaded as the conversion reaches it) is held until an object upload has arrived. Uploads that waited
    for the conversion's end would never arrive (the hold gives up after 60 s, and the order is checked)."""
    source = checkpoints("llama", "60KB")
    shards = sorted(source.glob("*.safetensors"))
    logged_in.add_repo("org/tiny", {p.name: p for p in source.iterdir() if p.is_file()})
    held = logged_in.fail(("org/tiny"), shards[-1].name, "hold", after_bytes=1000, times=1, ranged=False)
    out = tmp_path / "out"
    # The client's read timeout outlasts the hold: a loaded machine's first upload may come after the default 10 s,
    # and a timed-out download would resume with a ranged request the hold lets through.
    proc = start_cli("convert", "org/tiny", str(out), "--device", "cpu", "--max-shard-size", "30KB",
                     "--push-to-hub", PUSHED, "--json", env={"HF_HUB_DOWNLOAD_TIMEOUT": "120"})
    try:
        while not _object_uploads(logged_in) and proc.poll() is None and not held.release.is_set():
            time.sleep(0.01)
        first_upload = min(r.at for r in logged_in.request_log if r.method == "PUT")
    finally:
        held.release.set()
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr
    written = sorted(p.stat().st_mtime for p in out.glob("*.safetensors"))
    assert len(written) >= 3 and first_upload < written[-1]
    assert json.loads(stdout)["hub_commit_url"].endswith(logged_in.head(PUSHED))
    _assert_published(logged_in, out)
    sent = _object_uploads(logged_in)
    assert len(sent) == len(set(sent)) == len(written)  # each shard once, none again with the commit


def test_a_killed_push_is_finished_by_the_same_command_with_nothing_sent_twice(
    logged_in: HubServer, carded_source: Path, tmp_path: Path
):
    out = tmp_path / "out"
    command = ("convert", str(carded_source), str(out), "--device", "cpu", "--max-shard-size", "100KB",
               "--push-to-hub", PUSHED)
    stall = logged_in.stall("lfs_upload", skip=1)  # the first object arrives; the second is caught mid-push
    proc = start_cli(*command)
    try:
        assert stall.arrived.wait(120), proc.communicate()[1] if proc.poll() is not None else "no second upload"
        proc.kill()
        proc.wait()
    finally:
        stall.release.set()  # its body had arrived: the Hub keeps that object
    sent = _object_uploads(logged_in)
    assert len(sent) == 2 and logged_in.commits(PUSHED)[0].message == "initial commit"
    logged_in._stalls.clear()

    again = run_cli(*command)
    assert again.returncode == 0, again.stderr
    everything = _object_uploads(logged_in)
    assert len(everything) == len(set(everything)), "an object was sent twice"
    _assert_published(logged_in, out)
    assert len(set(everything)) == len(list(out.glob("*.safetensors")))


# ------------------------------------------------------------------------------------------- CI


def _prequant_invocations(script: str) -> list[list[str]]:
    """Each `prequant ...` command of a run: script, as argv (line continuations joined)."""
    commands = []
    for line in script.replace("\\\n", " ").splitlines():
        for part in line.split("&&"):
            argv = shlex.split(part.split(">")[0], comments=True)
            if argv and argv[0] == "prequant":
                commands.append(argv)
    return commands


def test_workflow_is_valid_yaml_using_existing_commands_and_options():
    workflow = yaml.safe_load(WORKFLOW.read_text())
    assert set(workflow[True]) == {"workflow_dispatch"}  # YAML 1.1 reads the key `on` as True
    steps = [step for job in workflow["jobs"].values() for step in job["steps"]]
    assert any(s.get("uses", "").startswith("actions/upload-artifact@") for s in steps)
    assert any("secrets.HF_TOKEN" in str(s.get("env", {}).get("HF_TOKEN")) for s in steps)
    used = [argv for s in steps if "run" in s for argv in _prequant_invocations(s["run"])]
    assert {argv[1] for argv in used} >= {"convert", "verify", "upload"}
    for argv in used:
        code, help_text, stderr = run_main(argv[1], "--help")
        assert code == 0, f"prequant {argv[1]} --help: {stderr}"
        for option in (a for a in argv[2:] if a.startswith("--")):
            assert option in help_text, f"prequant {argv[1]} has no option {option}"


def test_an_edited_card_is_uploaded_as_edited(logged_in: HubServer, out: Path):
    (out / "README.md").write_text((out / "README.md").read_text() + "\nEdited before publishing.\n")
    code, stdout, stderr = run_main("upload", str(out), "me/edited", "--json")
    assert code == 0, stderr
    assert logged_in.files("me/edited")["README.md"].endswith(b"Edited before publishing.\n")


@pytest.mark.parametrize("job", ["convert", "merge"])
def test_push_to_hub_private_creates_a_private_repo(logged_in: HubServer, carded_source: Path, tmp_path, job):
    """A converted (or merged) gated model pushed with --push-to-hub --private lands in a new private repo."""
    from adapters import make_adapter

    first = (str(carded_source),) if job == "convert" else (
        str(make_adapter(carded_source, tmp_path / "adapter", target_modules=["q_proj"])),)
    base = () if job == "convert" else ("--base", str(carded_source))
    proc = run_cli(job, *first, str(tmp_path / "out"), *base, "--device", "cpu", "--push-to-hub", "me/secret",
                   "--private")
    assert proc.returncode == 0, proc.stderr
    assert logged_in._find("me/secret").private
    assert logged_in.files("me/secret")["prequant.json"] == (tmp_path / "out" / "prequant.json").read_bytes()
