"""`merging.folder`: the adapter's files hashed ahead (the CLI starts it before torch's import) give the digests
the job's fingerprint and the manifest record, and a file that changed since is hashed again."""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

import pytest

from prequant.merging import folder


def _adapter(path: Path, weights: bytes) -> Path:
    path.mkdir()
    (path / folder.CONFIG_NAME).write_text('{"peft_type": "LORA"}')
    (path / folder.WEIGHT_NAMES[0]).write_bytes(weights)
    return path


def _hashed_ahead() -> None:
    """Wait for the hashing threads `hash_ahead` started."""
    for t in threading.enumerate():
        if t.name == "prequant-adapter-hash":
            t.join()


def test_files_hashed_ahead_give_their_sha256(tmp_path):
    adapter = _adapter(tmp_path / "adapter", os.urandom(3 << 20))
    folder.hash_ahead(str(adapter))
    for name in (folder.CONFIG_NAME, folder.WEIGHT_NAMES[0]):
        assert folder.sha256(adapter / name) == hashlib.sha256((adapter / name).read_bytes()).hexdigest()


def test_a_file_rewritten_after_its_hash_ahead_is_hashed_again(tmp_path):
    adapter = _adapter(tmp_path / "adapter", b"a" * 4096)
    weights = adapter / folder.WEIGHT_NAMES[0]
    folder.hash_ahead(str(adapter))
    _hashed_ahead()
    weights.write_bytes(b"b" * 4096)  # same size
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # a later mtime, whatever the clock
    assert folder.sha256(weights) == hashlib.sha256(b"b" * 4096).hexdigest()


def test_a_file_gone_since_its_hash_ahead_is_reported_when_asked_for(tmp_path):
    adapter = _adapter(tmp_path / "adapter", b"a" * 4096)
    folder.hash_ahead(str(adapter))
    _hashed_ahead()
    (adapter / folder.WEIGHT_NAMES[0]).unlink()
    with pytest.raises(FileNotFoundError):
        folder.sha256(adapter / folder.WEIGHT_NAMES[0])


def test_a_hub_id_or_a_file_is_left_alone_then_hashed_when_asked_for(tmp_path):
    folder.hash_ahead(str(tmp_path / "org-name"))  # a Hub repo id, say: nothing local to hash
    (tmp_path / "file").write_bytes(b"x")
    folder.hash_ahead(str(tmp_path / "file"))
    assert folder.sha256(tmp_path / "file") == hashlib.sha256(b"x").hexdigest()
