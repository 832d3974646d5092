"""`prequant change-storage`: a converted checkpoint with its packed 4-bit weights stored as another dtype.

bitsandbytes' 4-bit codes are bytes; `bnb_4bit_quant_storage` only says which dtype the tensor holding them claims
to be: the training dtype for FSDP (which shards them with the other parameters), uint8 for vLLM and SGLang (which
refuse anything else). So one conversion serves both: this rewrites each shard's header (the packed weights' dtype
and shape, laid out as the writer lays out a conversion with that storage), config.json's quantization_config, the
storage-dependent part of the card and prequant.json, and has the kernel copy every tensor's bytes
(copy_file_range). The result is what `convert --quant-storage X` writes, byte for byte; bf16 -> uint8 -> bf16 gives
back the original files.

The input is verified first, as `upload` does. DEST is checked, locked, staged and published (config.json last) as a
conversion's OUTPUT_DIR is (`output`), and called DEST when refused: here OUTPUT_DIR is the input.
"""

from __future__ import annotations

import copy
import json
import math
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..bnb.format import STORAGE_CODES, choice, decode_quant_state, packed_bytes, packed_length, split_state_key
from ..checkpoint.dtypes import itemsize, torch_name
from ..checkpoint.hf_files import CARD, CONFIG, SAFETENSORS_INDEX, SAFETENSORS_SINGLE, read_weight_map
from ..checkpoint.manifest import MANIFEST, load as load_manifest, sha256_file
from ..checkpoint.safetensors import read_header
from ..checkpoint.tensors import TensorRef
from ..errors import PrequantError, UsageError, skipping, spelled
from ..util.fsio import write_json
from ..util.progress import Progress
from ..verify.check import VerificationFailed, count
from ..verify.run import verify
from . import card, output
from .plan import OutTensor
from .writer import ShardWriter


@dataclass
class StorageChange:
    """What `change_storage` did; printed on stdout (text or JSON)."""

    output_dir: str
    source: str
    old_storage: str
    new_storage: str
    shards: int
    packed_weights: int
    bytes_copied: int
    seconds: float
    card: str  # "rewritten", or "kept as edited" (a card edited after the conversion is left alone)
    warnings: list[str] = field(default_factory=list)
    already_complete: bool = False  # DEST held this change, finished: nothing was written

    def to_dict(self) -> dict:
        d = asdict(self)
        if not d["already_complete"]:  # said only when there is something to say, as convert's summary does
            del d["already_complete"]
        return d

    def to_text(self) -> str:
        what = (f"{self.packed_weights} packed weights stored as {self.new_storage} (were {self.old_storage}), "
                f"{count(self.shards, 'shard')}")
        if self.already_complete:
            return (f"already complete: {self.output_dir} holds this change of {self.source}, finished earlier; "
                    f"nothing was written ({what})")
        lines = [f"wrote {self.output_dir}: {what}, {self.bytes_copied / 1e9:.3f} GB copied in {self.seconds:.1f} s",
                 f"card: {self.card}"]
        return "\n".join(lines + [f"warning: {w}" for w in self.warnings])


JOBS_BY_STORAGE = "job_by_storage"  # prequant.json: storage -> the job fingerprint of the conversion to it


def storage_name(value: str | torch.dtype) -> str:
    """A packed-weight storage given as its name ("uint8", any case) or a torch dtype (torch.uint8), as its name; a
    UsageError names the option as its caller wrote it (`--quant-storage`, or `quant_storage=`)."""
    name = torch_name(value) if isinstance(value, torch.dtype) else value
    return choice("quant_storage", name, given=value)


def change_storage(
    output_dir: str | Path, dest: str | Path, quant_storage: str | torch.dtype, *, overwrite: bool = False,
    progress: bool = True,
) -> StorageChange:
    """Write into `dest` the checkpoint of `output_dir` (a prequant output) with its packed weights stored as
    `quant_storage` ("bfloat16", "float16", "float32" or "uint8", or that torch dtype). Raises PrequantError when
    the input does not verify or a packed weight's codes do not fit the new storage exactly (named, with the
    fix). A refusal names the options as its caller writes them (`--overwrite`, or `overwrite=True`)."""
    started = time.monotonic()
    src, out = Path(output_dir), Path(dest)
    quant_storage = storage_name(quant_storage)
    if (complete := _complete(src, out, quant_storage, started)) is not None:  # nothing to read, hash or write
        return complete
    report = verify(src, progress=progress)
    if not report.ok:
        raise VerificationFailed(report, f"refusing to change the storage of {src}, it does not verify")
    manifest = load_manifest(src)
    config = json.loads((src / CONFIG).read_text())
    old = config["quantization_config"].get("bnb_4bit_quant_storage", "uint8")
    if old == quant_storage:
        raise UsageError(f"{src} is already stored as {quant_storage}; nothing to change")
    try:
        return _change(src, out, manifest, config, old, quant_storage, overwrite, progress, started)
    except PrequantError as e:  # `output` calls the folder it writes OUTPUT_DIR, which here is the input
        if "OUTPUT_DIR" not in e.detail:
            raise
        detail = e.detail.replace("an OUTPUT_DIR", "a DEST").replace("OUTPUT_DIR", "DEST")
        raise (UsageError if isinstance(e, UsageError) else PrequantError)(detail, where=e.where) from e


def _change(src: Path, out: Path, manifest: dict, config: dict, old: str, quant_storage: str, overwrite: bool,
            progress: bool, started: float) -> StorageChange:
    out = output.target(out, src, overwrite=overwrite, resume=False)  # refused as convert refuses it
    shards = _shard_names(src)
    code = STORAGE_CODES[quant_storage]
    plans = {name: _rewritten(src / name, code, quant_storage) for name in shards}  # all checked before writing
    packed = sum(len(p) for _, _, p in plans.values())
    # One writer per DEST, as for convert (the lock is not a job: no --resume here).
    with output.claim(out, "", overwrite=overwrite, resume=False):
        staging = output.staging_dir(out)
        digests: dict[str, str] = {}
        total = sum((src / name).stat().st_size for name in shards)
        with Progress(total, enabled=progress, label="copying") as bar:
            for name in shards:
                digests[name] = _write_shard(src / name, staging / name, *plans[name], code)
                bar.advance((src / name).stat().st_size)
        config["quantization_config"] = {**config["quantization_config"], "bnb_4bit_quant_storage": quant_storage}
        write_json(staging / CONFIG, config)
        card_state, warnings = _card(src, staging, manifest, old, quant_storage, config)
        for name in manifest["files"]:
            if name not in shards and name not in (CONFIG, CARD):
                (staging / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(src / name, staging / name)  # copy_file_range / sendfile under the hood on Linux
        _write_manifest(staging, manifest, quant_storage, digests, card_state)
        output.publish(out, staging)
    return StorageChange(str(out), str(src), old, quant_storage, len(shards), packed, total,
                         time.monotonic() - started, card_state, warnings)


def _shard_names(src: Path) -> list[str]:
    """The shards of a verified output: those its index names, or its single file."""
    if (src / SAFETENSORS_INDEX).is_file():
        return sorted(set(read_weight_map(src / SAFETENSORS_INDEX).values()))
    return [SAFETENSORS_SINGLE]


def _rewritten(path: Path, code: str, storage: str) -> tuple[list[TensorRef], dict[str, str], set[str]]:
    """The shard's tensors, its metadata, and the keys of its packed weights, checked to fit `code` exactly."""
    refs, metadata = read_header(path)
    by_key = {r.name: r for r in refs}
    packed: set[str] = set()
    with open(path, "rb", buffering=0) as f:
        for ref in refs:
            if (split := split_state_key(ref.name)) is None:
                continue
            weight = by_key[split[0]]
            n = math.prod(decode_quant_state(os.pread(f.fileno(), ref.nbytes, ref.offset))["shape"])  # verified
            need = packed_bytes(n)
            if weight.nbytes != need:
                raise PrequantError(
                    f"its {n:,} 4-bit codes need {need:,} bytes but its {weight.dtype} storage holds {weight.nbytes:,}: "
                    "bitsandbytes sizes wide storage as (n + 1) // (2 * itemsize) elements, which dropped the last "
                    f"byte; convert the original again with {spelled('quant_storage', 'uint8')}", where=weight.name)
            if packed_length(n, code) * itemsize(code) != need:
                raise PrequantError(
                    f"its {n:,} 4-bit codes take {need:,} bytes, which {storage} storage cannot hold whole "
                    f"(bitsandbytes sizes it as (n + 1) // (2 * itemsize) elements and would drop the last byte); "
                    "keep this checkpoint's storage, or convert the original again with "
                    f"{skipping(weight.name.removesuffix('.weight'))}",
                    where=weight.name)
            packed.add(weight.name)
    return refs, metadata, packed


def _write_shard(src: Path, dst: Path, refs: list[TensorRef], metadata: dict[str, str], packed: set[str],
                 code: str) -> str:
    """The shard with its packed weights stored as `code`, laid out as the writer lays out a conversion with that
    storage; return its sha256. Every tensor's bytes are copied by the kernel; the quant-state JSON (a few hundred
    bytes each) goes through the writer as a conversion's does."""
    entries = [_entry(r, packed, code) for r in refs]
    writer = ShardWriter(dst, entries, metadata)
    digest: list[str] = []
    try:
        with open(src, "rb", buffering=0) as f:
            for r in refs:
                if split_state_key(r.name) is not None:
                    writer.restore(r.name, os.pread(f.fileno(), r.nbytes, r.offset))
                else:
                    writer.copy_range(r.name, f.fileno(), r.offset, r.nbytes)
            writer.finalize(on_sealed=lambda sealed: digest.append(sha256_file(sealed, mapped=True)))
    except BaseException:
        writer.abort()
        raise
    return digest[0]


def _entry(r: TensorRef, packed: set[str], code: str) -> OutTensor:
    """How the writer lays out tensor `r` in the new shard."""
    if r.name in packed:  # the same bytes, as `bnb.format` shapes a packed weight: [count, 1] of the storage dtype
        return OutTensor(r.name, code, (r.nbytes // itemsize(code), 1))
    if split_state_key(r.name) is not None:
        return OutTensor(r.name, "U8", None)  # the writer puts quant states last, as a conversion does
    return OutTensor(r.name, r.dtype, r.shape)


def _card(src: Path, staging: Path, manifest: dict, old: str, new: str, config: dict) -> tuple[str, list[str]]:
    """The card with its storage-dependent part rewritten; an edited card is kept as it is, with a warning."""
    path = src / CARD
    listed = manifest["files"].get(CARD)
    if not path.is_file():
        return "none", []
    text = path.read_text(encoding="utf-8")
    edited = listed is None or sha256_file(path) != listed["sha256"]
    changed = None if edited else card.change_storage(text, old, new, config["quantization_config"].get(
        "bnb_4bit_compute_dtype", "float32"))
    if changed is None:
        shutil.copyfile(path, staging / CARD)
        return "kept as edited", [f"{CARD} was edited after the conversion and is kept as it is; its loading "
                                  f"instructions may still describe {old} storage: update them for {new}"]
    (staging / CARD).write_text(changed, encoding="utf-8")
    return "rewritten", []


def _complete(src: Path, out: Path, storage: str, started: float) -> StorageChange | None:
    """What DEST holds when it is this change of `src`, finished earlier (as convert and merge say of a finished
    job), found from the records and the headers alone; None otherwise (a `src` that is no prequant output
    included: verify says what is wrong with it)."""
    try:
        manifest = load_manifest(src)
        old = json.loads((src / CONFIG).read_text())["quantization_config"].get("bnb_4bit_quant_storage", "uint8")
        shards = _shard_names(src)
        done = None if old == storage else _written_before(src, out, manifest, storage, shards)
        if done is None:
            return None
        packed = sum(split_state_key(r.name) is not None for name in shards for r in read_header(out / name)[0])
    except (PrequantError, OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    recorded = done["files"].get(CARD)  # a rewritten card's hash is its own, an edited one keeps the source's
    card_state = ("none" if not (out / CARD).is_file() else
                  "rewritten" if recorded is not None and recorded != manifest["files"].get(CARD) else "kept as edited")
    return StorageChange(str(out), str(src), old, storage, len(shards), packed, 0, time.monotonic() - started,
                         card_state, already_complete=True)


def _written_before(src: Path, out: Path, manifest: dict, storage: str, shards: list[str]) -> dict | None:
    """DEST's prequant.json when DEST holds this change of `src`, finished and intact: that record is what this
    change writes (everything but the hashes of the files it rewrites: shards, config.json, card), and its files
    have the sizes it lists, as a finished conversion is recognised (`output`); else None."""
    try:
        done = json.loads((out / MANIFEST).read_text())
        stored = json.loads((out / CONFIG).read_text())["quantization_config"]["bnb_4bit_quant_storage"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not isinstance(done, dict) or not isinstance(done.get("files"), dict) or stored != storage:
        return None
    rewritten = {*shards, CONFIG, CARD}

    def kept(m: dict) -> dict:
        return {**m, "files": {k: v for k, v in m["files"].items() if k not in rewritten}}

    same = set(done["files"]) == set(manifest["files"]) and kept(done) == kept(_changed_manifest(manifest, storage))
    return done if same and output.changed_files(out) is None else None


def _changed_manifest(manifest: dict, storage: str) -> dict:
    """The conversion's record with the storage changed (the files' hashes as they were)."""
    new = copy.deepcopy(manifest)
    old_storage = new["options"]["quant_storage"]
    new["options"]["quant_storage"] = storage
    # The job fingerprint covers the conversion's plan, storage included, and cannot be recomputed without the
    # source; kept as it is, a rerun of the old options would call this output complete. So it is remembered under
    # its storage and the new one is null, unless this storage's job is remembered: changing back gives the
    # conversion's own prequant.json.
    if "job" in new:
        jobs = new.pop(JOBS_BY_STORAGE, {})
        if new["job"] is not None:
            jobs[old_storage] = new["job"]
        new["job"] = jobs.pop(storage, None)
        if jobs:
            new[JOBS_BY_STORAGE] = jobs
    return new


def _write_manifest(staging: Path, manifest: dict, storage: str, digests: dict[str, str], card_state: str) -> None:
    """prequant.json of the new files: the conversion's record, with the storage and the files' hashes changed (an
    edited card keeps its recorded hash, so that verify still says it was edited)."""
    new = _changed_manifest(manifest, storage)
    changed = [*digests, CONFIG, *([CARD] if card_state == "rewritten" else [])]
    for name in changed:
        path = staging / name
        new["files"][name] = {"size": path.stat().st_size, "sha256": digests.get(name) or sha256_file(path)}
    write_json(staging / MANIFEST, new, sort_keys=False)
