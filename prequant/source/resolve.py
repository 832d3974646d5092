"""Resolve SOURCE (a local directory, a Hub repo id, or an alias) into the files to convert; list and read its
tensors. Local directories are `local`'s, Hub repos `hub_stream`'s (imported only for them: huggingface_hub
costs its import time)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ..checkpoint.reader import TensorReader, scan_files
from ..checkpoint.tensors import TensorRef
from ..errors import PrequantError, UsageError
from .local import local
from .spec import ALIASES, Source, hub_spec


def resolve(spec: str, *, stream: bool = False) -> Source:
    """Find the checkpoint named by `spec`; fail early with what to do when there is none.

    `spec` is a local directory, else a Hub repo ``org/name[@revision]`` or an alias from `ALIASES`. A Hub
    source's small files (config, index, tokenizer, code, card) are downloaded into the Hugging Face cache;
    its weight shards too, unless `stream` (then `scan` reads their headers remotely and `reader`
    downloads them one by one as a conversion reaches them).
    """
    try:
        path = Path(spec).expanduser()
        exists = path.exists()
    except (OSError, ValueError, RuntimeError) as e:  # name too long, NUL byte, ~unknown-user
        raise PrequantError(f"source {spec!r} is not a usable path ({e}); pass a local checkpoint directory") from e
    if exists:
        return local(spec, path)
    repo = hub_spec(spec)
    if repo is not None:
        from . import hub_stream

        return hub_stream.resolve(spec, *repo, stream=stream)
    raise PrequantError(
        f"source {spec!r} does not exist; pass a local checkpoint directory (holding config.json and "
        f"*.safetensors weights), a Hub repo as org/name[@revision], or an alias ({', '.join(ALIASES)})"
    )


def scan(src: Source) -> list[TensorRef]:
    """Every tensor of the source, in file order (a streamed Hub source: from remote headers)."""
    if src.hub is not None:
        from . import remote_headers

        return remote_headers.scan(src)
    return scan_files(src.weight_files)


def reader(src: Source, tensors: Sequence[TensorRef], *, delete: bool = False) -> TensorReader:
    """The TensorReader of the source's data; for a Hub source, one that downloads the shards as the `tensors`
    (in the order they will be read) reach them.

    `delete` (Hub sources only): evict each shard prequant downloaded from the cache once its tensors are
    written; call the returned reader's `tensor_done(ref)` as each tensor is written."""
    check_delete(src, delete)
    if src.hub is None:
        return TensorReader()
    from . import hub_stream

    return hub_stream.HubShardReader(src, tensors, delete=delete)


def check_delete(src: Source, delete: bool) -> None:
    """Deleting source shards is for a Hub source's downloads only, never for a user's directory."""
    if delete and src.hub is None:
        raise UsageError(
            f"--delete-source-shards only applies to a Hub source; {src.path} is a local directory, and prequant "
            "never deletes files there"
        )
