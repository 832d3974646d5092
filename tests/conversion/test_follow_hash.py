"""conversion.follow_hash: a shard's sha256 following its writes, for shards whose header the plan fixes.

What must hold: the digest is the sealed file's, whatever order the tensors are written in and however a copy is
split; it never reads past what the writer has marked written; a shard with quant-state JSON (whose header is known
only at the end) is hashed after it is sealed, as before; an abandoned shard's hash ends instead of waiting; and in a
real conversion every shard's recorded sha256 is its file's, kept-only shards hashed as they were written.
"""

from __future__ import annotations

import hashlib
import json
import threading

import torch

import prequant
from prequant.checkpoint.safetensors import read_header
from prequant.conversion import plan as plan_module
from prequant.conversion import record, writer
from prequant.conversion.follow_hash import Cancelled, FollowHash
from prequant.conversion.plan import OutTensor


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _run(follow: FollowHash) -> tuple[threading.Thread, list]:
    out: list = []

    def body() -> None:
        try:
            out.append(follow.run())
        except BaseException as e:  # noqa: BLE001 - the test reads it
            out.append(e)

    t = threading.Thread(target=body)
    t.start()
    return t, out


def test_a_kept_only_shard_is_hashed_as_written_in_any_order(tmp_path, monkeypatch):
    monkeypatch.setattr(writer, "COPY_PIECE", 4096)  # a copy in many pieces, each marked as it lands
    entries = [OutTensor("a", "F32", (3000,)), OutTensor("b", "BF16", (5001,)), OutTensor("c", "F32", (17,))]
    w = writer.ShardWriter(tmp_path / "s.safetensors", entries)
    follow = w.follow()
    assert follow is not None and w.follow() is None, "one hash per shard"
    thread, out = _run(follow)
    src = tmp_path / "src.bin"
    b = torch.arange(5001, dtype=torch.float32).to(torch.bfloat16)
    src.write_bytes(b"x" * 100 + b.view(torch.uint8).numpy().tobytes())
    w.write("c", torch.ones(17))  # the last bytes first: the hash may not pass the gap before them
    thread.join(0.2)
    assert thread.is_alive() and not out
    with open(src, "rb") as f:
        w.copy_range("b", f.fileno(), 100, b.numel() * 2)
    w.write("a", torch.arange(3000, dtype=torch.float32))
    path = w.finalize()
    thread.join(30)
    assert out == [_sha(path)]
    got = read_header(path)[0]
    assert {t.name for t in got} == {"a", "b", "c"}


def test_a_shard_with_quant_state_json_is_not_followed(tmp_path):
    entries = [OutTensor("w", "U8", (8, 1)), OutTensor("w.quant_state.bitsandbytes__nf4", "U8", None)]
    assert writer.ShardWriter(tmp_path / "q.safetensors", entries).follow() is None


def test_an_abandoned_shard_ends_its_hash(tmp_path):
    w = writer.ShardWriter(tmp_path / "s.safetensors", [OutTensor("a", "F32", (1 << 20,))])
    thread, out = _run(w.follow())
    w.abort()
    thread.join(30)
    assert not thread.is_alive() and isinstance(out[0], Cancelled)


def test_every_shard_of_a_conversion_has_its_files_sha256(checkpoints, tmp_path, monkeypatch):
    """A tiny Llama in small shards, the embedding and lm_head kept alone in theirs (hashed as written): each shard's
    recorded sha256 is the file's, and verify agrees."""
    from prequant.verify.run import verify

    followed: list[str] = []
    real = record.Recorder.on_follow

    def counted(self, name, follow):
        followed.append(name)
        real(self, name, follow)

    monkeypatch.setattr(record.Recorder, "on_follow", counted)
    monkeypatch.setattr(plan_module, "TAIL_SHARD", 10_000)
    src, out = checkpoints("llama"), tmp_path / "out"
    prequant.convert(src, out, device="cpu", progress=False, max_shard_size="60KB")
    files = json.loads((out / "prequant.json").read_text())["files"]
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    for name in shards:
        assert files[name]["sha256"] == _sha(out / name), name
    kept_only = [n for n in shards if not any(".quant_state." in t.name for t in read_header(out / n)[0])]
    assert kept_only and sorted(followed) == kept_only
    assert verify(out, src, progress=False).ok


def test_the_hash_never_reads_past_what_is_written(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"\0" * (16 << 20))  # as preallocated: zeros until written
    follow = FollowHash(path, b"head", 16 << 20)
    thread, out = _run(follow)
    thread.join(0.3)
    assert thread.is_alive() and not out, "nothing past the header is marked written yet"
    with open(path, "r+b") as f:
        f.seek(4)
        f.write(b"\1" * ((16 << 20) - 4))
    follow.advance(16 << 20)
    thread.join(30)
    assert out == [hashlib.sha256(b"head" + b"\1" * ((16 << 20) - 4)).hexdigest()]
