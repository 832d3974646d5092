"""A Hub source's tensors from its shards' headers, read by HTTP range requests instead of downloads.

Planning needs every tensor's name, dtype and shape before any work, but a 600 GB checkpoint should not
have to be on disk to be planned. So `spec.hub` downloads the repo's small files (config, index,
tokenizer, code, card) first, then each weight shard's header is read with HTTP range requests: a
safetensors header directly, a PyTorch `.bin` shard's pickle through `torch.load(weights_only=True,
map_location="meta")` over a seekable remote file (the zip directory and `data.pkl`, a few hundred KB,
never the tensor data; torch's restricted unpickler refuses anything but tensors). The resulting
`TensorRef`s point at the path each shard will have in the Hugging Face cache.
"""

from __future__ import annotations

import io
import pickle
import zipfile
from pathlib import Path

from ..checkpoint import binreader
from ..checkpoint.reader import bin_refs, scan_files
from ..checkpoint.safetensors import header_length, parse_header
from ..checkpoint.tensors import TensorRef, merge
from ..errors import PrequantError
from ..hub import client
from .spec import Source

BLOCK = 256 * 1024  # remote reads are whole blocks: a safetensors header usually fits in the first


def scan(src: Source) -> list[TensorRef]:
    """Every tensor of a Hub source, as `checkpoint.reader.scan_files` would give them once downloaded, from each shard's
    header: read from the cache when the shard is there, else by range requests."""
    from concurrent.futures import ThreadPoolExecutor

    assert src.hub is not None
    with ThreadPoolExecutor(max_workers=min(8, len(src.weight_files)), thread_name_prefix="prequant-header") as pool:
        per_file = list(pool.map(lambda path: _shard_refs(src, path), src.weight_files))
    return merge(per_file, f"{src.repo_id} is inconsistent at this revision, pick another revision")


def _shard_refs(src: Source, path: Path) -> list[TensorRef]:
    assert src.hub is not None
    name = path.relative_to(src.path).as_posix()
    if complete(src, path):
        return scan_files([path])
    remote = RemoteFile(src.hub, name)
    label = f"{name} of {src.repo_id}@{src.hub.sha[:12]}"  # the repo's file, not its future cache path
    return _bin_refs(remote, path, label) if path.suffix == ".bin" else _safetensors_refs(remote, path, label)


def complete(src: Source, path: Path) -> bool:
    assert src.hub is not None
    try:
        return path.stat().st_size == src.hub.files[path.relative_to(src.path).as_posix()]
    except OSError:
        return False


def _safetensors_refs(remote: RemoteFile, path: Path, label: str) -> list[TensorRef]:
    """`checkpoint.safetensors.read_header`'s checks, on the header bytes of a remote file."""
    n = header_length(path, remote.read(8), remote.size, label=label)
    refs, _ = parse_header(path, remote.read(n), remote.size, label=label)
    return sorted(refs, key=lambda r: r.offset)


def _bin_refs(remote: RemoteFile, path: Path, label: str) -> list[TensorRef]:
    """A remote PyTorch shard's tensors from its pickle alone (meta tensors: no data is read)."""
    import torch

    f = io.BufferedReader(remote, BLOCK)
    if not zipfile.is_zipfile(f):
        raise PrequantError(
            f"{label}: not a zip-format PyTorch checkpoint (legacy torch.save or corrupt); convert it to "
            "safetensors first"
        )
    f.seek(0)
    try:
        state = torch.load(f, map_location="meta", weights_only=True)
    except pickle.UnpicklingError as e:
        raise binreader.refused(label, e) from e
    except PrequantError:
        raise
    except Exception as e:  # torch wraps errors raised by our reads
        if remote.error is not None:
            raise remote.error from e
        raise PrequantError(f"{label}: cannot read this PyTorch checkpoint ({type(e).__name__}); re-download it") from e
    return bin_refs(path, binreader.check_state(label, state))  # the same checks as a local shard, on meta tensors


class RemoteFile(io.RawIOBase):
    """A read-only, seekable Hub file: reads become range requests for whole blocks, kept once fetched."""

    def __init__(self, source: client.HubCommit, filename: str) -> None:
        super().__init__()
        self.source, self.filename, self.size = source, filename, source.files[filename]
        self.error: PrequantError | None = None  # the last failed read (torch hides it behind its own error)
        self._pos = 0
        self._blocks: dict[int, bytes] = {}

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer) -> int:  # type: ignore[override]
        n = min(len(buffer), self.size - self._pos)
        if n <= 0:
            return 0
        first, last = self._pos // BLOCK, (self._pos + n - 1) // BLOCK
        missing = [i for i in range(first, last + 1) if i not in self._blocks]
        if missing:  # one request for the whole run of blocks
            start, end = missing[0] * BLOCK, min(self.size, (missing[-1] + 1) * BLOCK)
            try:
                data = client.read_range(self.source, self.filename, start, end)
            except PrequantError as e:
                self.error = e
                raise
            for i in range(missing[0], missing[-1] + 1):
                self._blocks[i] = data[(i - missing[0]) * BLOCK : (i - missing[0] + 1) * BLOCK]
        data = b"".join(self._blocks[i] for i in range(first, last + 1))
        skip = self._pos - first * BLOCK
        buffer[:n] = data[skip : skip + n]
        self._pos += n
        return n


__all__ = ["RemoteFile", "complete", "scan"]
