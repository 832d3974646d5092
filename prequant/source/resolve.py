"""Resolve SOURCE (a local directory, a Hub repo id, or an alias) into the files to convert; list and read its
tensors. What each kind of SOURCE is, is `spec`'s; a Hub source's headers are `remote_headers`' and its shards
`hub_stream`'s (imported only for them: huggingface_hub costs its import time).

A conversion opens its source here in three steps, each complete: `resolve` (where the checkpoint is: its
directory and files), `contents` (what it holds: every tensor, checked against the index, and config.json) and
`reader` (its data, a Hub source's downloads started). Between the first two the caller checks where the output
goes, before any header is read."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ..checkpoint import quantized
from ..checkpoint.hf_files import check_index, read_config
from ..checkpoint.reader import TensorReader, scan_files
from ..checkpoint.tensors import TensorRef
from ..errors import UsageError, flag
from .spec import Contents, Source, hub, local, where


def resolve(spec: str, *, stream: bool = False, delete: bool = False) -> Source:
    """Find the checkpoint named by `spec`; fail early with what to do when there is none.

    `spec` is a local directory, else a Hub repo ``org/name[@revision]`` or an alias from `ALIASES`. A Hub
    source's small files (config, index, tokenizer, code, card) are downloaded into the Hugging Face cache;
    its weight shards too, unless `stream` (then `scan` reads their headers remotely and `reader`
    downloads them one by one as a conversion reaches them). `delete`: the caller will delete the shards it
    downloads (`check_delete`: refused for a local directory).
    """
    found = where(spec)
    if isinstance(found, Path):
        src = local(spec, found)
        check_delete(src, delete)
        return src
    return hub(spec, *found, stream=stream)


def scan(src: Source) -> list[TensorRef]:
    """Every tensor of the source, in file order (a streamed Hub source: from remote headers)."""
    if src.hub is not None:
        from . import remote_headers

        return remote_headers.scan(src)
    return scan_files(src.weight_files)


def contents(src: Source) -> Contents:
    """What the source holds: every tensor, in file order (`scan`), checked against its index when it has one,
    and its config.json (which must exist, be a JSON object and not be quantized already); a quantized source as the
    16-bit checkpoint it stands for (`quantized.as_16bit`)."""
    tensors = scan(src)
    if src.index_file is not None:
        check_index(src.index_file, tensors)
    return Contents(*quantized.as_16bit(tensors, read_config(src.path), where=src.path / "config.json"))


def reader(src: Source, tensors: Sequence[TensorRef], *, delete: bool = False, start: bool = False) -> TensorReader:
    """The TensorReader of the source's data; for a Hub source, one that downloads the shards as the `tensors`
    (in the order they will be read) reach them: from now on with `start`, else from the first read.

    `delete` (Hub sources only): evict each shard prequant downloaded from the cache once its tensors are
    written; call the returned reader's `tensor_done(ref)` as each tensor is written. Not `start` for a resumed
    run before its journal has marked the finished tensors: it would download shards that are done. `resolve`
    refused `delete` for a local directory already."""
    if src.hub is None:
        return TensorReader()
    from . import hub_stream

    data = hub_stream.HubShardReader(src, quantized.stored(tensors), delete=delete)  # quantized weights: their stored tensors
    if start:
        data.start()
    return quantized.reading(data, tensors)


def check_delete(src: Source, delete: bool) -> None:
    """Deleting source shards is for a Hub source's downloads only, never for a user's directory."""
    if delete and src.hub is None:
        raise UsageError(
            f"{flag('delete_source_shards')} only applies to a Hub source; {src.path} is a local directory, and prequant "
            "never deletes files there"
        )
