"""verify's checks of the files: each against prequant.json (present, same size, same sha256, hashed in
parallel), and the shards against the index (every key where the index says, none unlisted, none twice)."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath

from ..checkpoint.hf_files import CARD, CONFIG, SAFETENSORS_INDEX, SAFETENSORS_SINGLE, read_weight_map
from ..checkpoint.manifest import MANIFEST, load as load_manifest, sha256_file
from ..checkpoint.safetensors import read_header
from ..checkpoint.tensors import TensorRef
from ..errors import PrequantError
from ..util import failpoints
from ..util.progress import Progress
from .report import Report

HASH_WORKERS = 4
# The model card is the one file users edit before publishing (and the Hub's editor rewrites): it is text for
# people, no loader reads it, so a changed card is said, not failed; upload sends it as it is.
EDITED_CARD = "edited since the conversion (its sha256 differs from prequant.json); upload sends it as it is"


# ------------------------------------------------------------------------------------------ files


def check_manifest(out: Path, report: Report) -> dict | None:
    """prequant.json, read and checked (None, with the problem reported, when it cannot be)."""
    try:
        return load_manifest(out)
    except PrequantError as e:
        report.fail(e.where or MANIFEST, e.detail)
        return None


def check_files(out: Path, manifest: dict, report: Report, progress: bool) -> set[str]:
    """Sizes first (cheap, catches truncation), then sha256 of the files whose size is right."""
    listed: dict[str, dict] = manifest["files"]
    report.listed_files = sorted(listed)
    bad: set[str] = set()
    to_hash: list[tuple[str, Path, str]] = []
    for name, entry in listed.items():
        path = _inside(out, name)
        if path is None:
            report.fail(name, "prequant.json names a file outside OUTPUT_DIR; the manifest is not trustworthy")
            bad.add(name)
        elif not path.is_file():
            report.fail(name, "missing (listed in prequant.json); the output is incomplete: copy it again or reconvert")
            bad.add(name)
        elif name == CARD and path.stat().st_size != entry["size"]:
            report.warn(name, EDITED_CARD)
        elif (size := path.stat().st_size) != entry["size"]:
            report.fail(
                name, f"{size:,} bytes but prequant.json says {entry['size']:,}: the file was truncated, edited or replaced"
            )
            bad.add(name)
        else:
            to_hash.append((name, path, entry["sha256"]))
    total = sum(listed[name]["size"] for name, _, _ in to_hash)
    pool = ThreadPoolExecutor(max_workers=max(1, min(HASH_WORKERS, os.cpu_count() or 1)),
                              thread_name_prefix="prequant-verify")
    try:
        with Progress(total, enabled=progress, label="hashing") as bar:
            digests = pool.map(lambda item: sha256_file(item[1], bar.advance), to_hash)
            for (name, _, expected), digest in zip(to_hash, digests):
                failpoints.hit("verify-hashed")
                if digest != expected and name == CARD:
                    report.warn(name, EDITED_CARD)
                elif digest != expected:
                    report.fail(name, "sha256 differs from prequant.json: the file was modified or corrupted; "
                                "re-download it or reconvert")
                    bad.add(name)
    except BaseException:
        # Interrupted (Ctrl-C, SIGTERM): stop at once rather than wait for files being hashed (gigabytes each).
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown()
    for path in sorted(out.rglob("*")):
        rel = path.relative_to(out).as_posix()
        if path.is_file() and rel not in listed and rel != MANIFEST:
            report.extra_files.append(rel)
            if rel.endswith((".safetensors", ".bin")) or rel in (CONFIG, SAFETENSORS_INDEX):
                report.fail(rel, "not listed in prequant.json: a stray checkpoint file; remove it or reconvert")
            else:
                report.warn(rel, "not listed in prequant.json (not part of the conversion)")
    report.files = {
        "listed": len(listed),
        "checked": len(listed) - len(bad),
        "bytes_hashed": total,
        "extra": len(report.extra_files),
    }
    return bad


def _inside(out: Path, name: str) -> Path | None:
    """`out / name`, or None when the name would lead outside OUTPUT_DIR (the manifest is data)."""
    parts = PurePosixPath(name).parts
    if not parts or PurePosixPath(name).is_absolute() or ".." in parts or "\\" in name:
        return None
    return out.joinpath(*parts)


# ----------------------------------------------------------------------------------------- shards


def check_shards(out: Path, report: Report, bad_files: set[str]) -> tuple[dict[str, TensorRef], dict[str, str]]:
    """Read every shard's header; check the index (or the single file) against what the shards hold."""
    weight_map = _read_index(out, report)
    if weight_map is not None:
        shard_names = sorted(set(weight_map.values()))
    elif (out / SAFETENSORS_SINGLE).is_file():
        shard_names = [SAFETENSORS_SINGLE]
    else:
        shard_names = []
        loose = sorted(p.name for p in out.glob("model-*.safetensors"))
        if loose:
            report.fail(SAFETENSORS_INDEX, f"missing, but shards like {loose[0]} exist; the output is incomplete")
        elif SAFETENSORS_SINGLE not in bad_files:
            report.fail(SAFETENSORS_SINGLE, f"no weights in {out} (neither it nor {SAFETENSORS_INDEX})")
    refs: dict[str, TensorRef] = {}
    shard_of: dict[str, str] = {}
    unreadable: set[str] = set()
    for name in shard_names:
        path = _inside(out, name)
        if path is None or "/" in name:
            report.fail(SAFETENSORS_INDEX, f"names shard {name!r}, which is not a file of OUTPUT_DIR")
            unreadable.add(name)
            continue
        if not path.is_file():
            if name not in bad_files:
                report.fail(name, f"missing, but {SAFETENSORS_INDEX} lists tensors in it; the output is incomplete")
            unreadable.add(name)
            continue
        try:
            tensors, metadata = read_header(path)
        except PrequantError as e:
            report.fail(name, e.detail)
            unreadable.add(name)
            continue
        if metadata.get("format") != "pt":
            report.fail(name, 'safetensors metadata lacks {"format": "pt"}, which transformers requires')
        for t in tensors:
            if t.name in shard_of:
                report.fail(t.name, f"stored twice, in {shard_of[t.name]} and {name}")
            else:
                refs[t.name], shard_of[t.name] = t, name
    index_ok = True
    if weight_map is not None:
        for key, shard in weight_map.items():
            if shard in unreadable:
                continue
            if key not in shard_of:
                report.fail(key, f"listed in {SAFETENSORS_INDEX} under {shard}, but no shard holds it")
                index_ok = False
            elif shard_of[key] != shard:
                report.fail(key, f"listed in {SAFETENSORS_INDEX} under {shard}, but stored in {shard_of[key]}")
                index_ok = False
        for key, shard in shard_of.items():
            if key not in weight_map:
                report.fail(key, f"stored in {shard} but not listed in {SAFETENSORS_INDEX}; loaders will not find it")
                index_ok = False
    report.tensors = {"count": len(refs), "shards": len(shard_names), "index_ok": index_ok and not unreadable}
    return refs, shard_of


def _read_index(out: Path, report: Report) -> dict[str, str] | None:
    path = out / SAFETENSORS_INDEX
    if not path.is_file():
        return None
    try:
        return read_weight_map(path)
    except PrequantError as e:
        report.fail(SAFETENSORS_INDEX, e.detail)
        return None
