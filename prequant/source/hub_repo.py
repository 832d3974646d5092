"""A Hub repo as a conversion source: resolved to a commit, its small files downloaded, its weights named.

`resolve` downloads the repo's small files (config, index, tokenizer, code, card) and names each weight shard by
the path it will have in the Hugging Face cache. Then `remote_headers` plans from the shards' headers, read by
HTTP range requests, without downloading them, and `hub_stream` downloads them as the conversion reaches them
(or, without `stream`, they are downloaded here, as a local directory would hold them).
"""

from __future__ import annotations

from ..checkpoint.hf_files import CONFIG, WEIGHT_SUFFIXES, shard_names, weight_layout
from ..errors import PrequantError
from ..hub import client
from .spec import Source


def resolve(spec: str, repo_spec: str, alias: str | None, *, stream: bool) -> Source:
    """Resolve a Hub repo to a commit, download its small files, and describe its weights (see module doc)."""
    try:
        repo_id, revision = client.parse_repo_spec(repo_spec)
        listing = client.resolve(repo_id, revision, alias=alias)
    except PrequantError as e:
        # "org/name" may also have been a mistyped local path: unless the repo plainly exists (gated, or only the
        # revision is unknown), say both (the Hub cannot be reached, no such repo, offline and not cached).
        from huggingface_hub.errors import GatedRepoError, RevisionNotFoundError

        exists = isinstance(e.__cause__, (GatedRepoError, RevisionNotFoundError))
        if alias is None and not exists:
            raise e.within(f"source {spec!r} is not a local directory, and ") from e
        raise
    label = f"{alias} ({repo_id}@{listing.sha[:12]})" if alias else f"{repo_id}@{listing.sha[:12]}"
    files = listing.files
    layout = weight_layout(files)
    if layout is None:
        found = sorted(name for name in files if name.endswith(WEIGHT_SUFFIXES))
        hint = f" (found {', '.join(found[:5])})" if found else ""
        raise PrequantError(
            f"{label}: no model weights found: expected model.safetensors or model.safetensors.index.json{hint}; "
            "pass the repo of a Hugging Face checkpoint"
        )
    if CONFIG not in files:
        raise PrequantError(
            f"{label}: config.json is missing from the repo; a Hugging Face checkpoint needs one next to its weights, "
            "pick a revision that has it"
        )
    index_name, single, fmt = layout
    # Everything but weights: what a conversion copies (tokenizer, code, licence) or reads (config, index, card).
    small = [n for n in files if not n.endswith(WEIGHT_SUFFIXES) and not n.startswith(".") and "/." not in n]
    for name in sorted(small, key=lambda n: (n != CONFIG, n != index_name, n)):
        client.download(listing, name)
    root = client.cache_path(listing, CONFIG).parent
    index = root / index_name if index_name else None
    names = shard_names(f"{repo_id}@{listing.sha[:12]}", index) if index else [single]
    for name in names:
        if name not in files:
            raise PrequantError(
                f"{index_name}: shard {name!r} is listed but missing from {label}; the repo is incomplete at this "
                "revision, pick another revision"
            )
    if not stream:  # the whole checkpoint on disk, as a local directory would be
        for name in names:
            client.download(listing, name)
    return Source(
        spec, root, tuple(root / n for n in names), index, fmt,
        repo_id=repo_id, revision=revision, sha=listing.sha, hub=listing,
    )
