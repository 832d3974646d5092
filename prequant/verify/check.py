"""`prequant verify`'s checks of an output on its own, and the Report they fill: prequant.json against the files
(present, same size, same sha256), the index against the shards (every key where the index says, none unlisted, none
twice), every quant state and its companions (present, same shard, dtypes and shapes the state implies, no stray
key), and config.json's quantization_config against the tensors. Each problem names the file or tensor it is about.
"""

from __future__ import annotations

import json
import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath

from ..bnb.format import (
    COMPANIONS,
    COMPUTE_NAMES,
    STORAGE_CODES,
    decode_quant_state,
    entries,
    is_nested,
    packed_length,
    quant_state_problems,
    split_state_key,
    state_key,
)
from ..bnb.loading import should_convert
from ..checkpoint.hf_files import CARD, CONFIG, SAFETENSORS_INDEX, SAFETENSORS_SINGLE, read_weight_map
from ..checkpoint.manifest import MANIFEST, load as load_manifest, sha256_file, unlisted
from ..checkpoint.reader import TensorReader
from ..checkpoint.safetensors import read_header
from ..checkpoint.tensors import TensorRef
from ..errors import PrequantError
from ..util import failpoints
from ..util.progress import Progress


@dataclass(frozen=True)
class Problem:
    """One finding: the file or tensor it is about, and what is wrong (with the fix when there is one)."""

    where: str
    message: str

    def __str__(self) -> str:
        return f"{self.where}: {self.message}"


@dataclass
class Report:
    """What verify found; `ok` only when there is no problem (warnings do not fail)."""

    output_dir: str
    problems: list[Problem] = field(default_factory=list)
    warnings: list[Problem] = field(default_factory=list)
    files: dict = field(default_factory=dict)
    extra_files: list[str] = field(default_factory=list)
    listed_files: list[str] = field(default_factory=list)  # what prequant.json lists (what upload sends)
    tensors: dict = field(default_factory=dict)
    config: dict = field(default_factory=dict)
    conversion_stats: dict | None = None
    source: dict | None = None

    @property
    def ok(self) -> bool:
        return not self.problems

    def fail(self, where: str, message: str) -> None:
        self.problems.append(Problem(where, message))

    def warn(self, where: str, message: str) -> None:
        self.warnings.append(Problem(where, message))

    def to_dict(self) -> dict:
        return {"ok": self.ok, **{k: v for k, v in asdict(self).items() if k != "listed_files"}}

    def to_text(self) -> str:
        status = "OK" if self.ok else f"FAILED ({count(len(self.problems), 'problem')})"
        lines = [f"verify {self.output_dir}: {status}"]
        if self.files:
            f = self.files
            lines.append(
                f"  files: {f['checked']} of {f['listed']} listed in prequant.json match (size and sha256, "
                f"{f['bytes_hashed'] / 1e9:.3f} GB hashed)"
            )
        if self.tensors:
            t = self.tensors
            lines.append(
                f"  tensors: {count(t['count'], 'key')} in {count(t['shards'], 'shard')}, {t['quantized']} quantized "
                f"({', '.join(t['quant_types']) or '-'}), index {'consistent' if t['index_ok'] else 'INCONSISTENT'}"
            )
        if self.config:
            lines.append(f"  config.json: {self._config_text()}")
        if self.conversion_stats and self.conversion_stats.get("tensors"):
            c = self.conversion_stats
            lines.append(
                f"  recorded at conversion: relative error median {c['median_rel_error']}, max "
                f"{c['max_rel_error']} ({c['max_rel_error_tensor']})"
            )
        if self.source:
            lines.append(f"  {self._source_text()}")
        lines += [f"  FAIL {p}" for p in self.problems]
        lines += [f"  warning {p}" for p in self.warnings]
        return "\n".join(lines)

    def _config_text(self) -> str:
        if "quantization_config" in self.config:
            return f"quantization_config {'agrees with' if self.config['ok'] else 'DISAGREES with'} the tensors"
        return "no quantization_config, and no 4-bit tensor" if self.config["ok"] else "FAILED (see below)"

    def _source_text(self) -> str:
        s = self.source
        kept = f"{count(s['kept'], 'kept tensor')} compared byte for byte"
        summary = s["summary"]
        if not summary.get("tensors"):
            return f"source {s['spec']}: no quantized tensor compared, {kept}"
        return (f"source {s['spec']}: {count(s['quantized'], 'quantized tensor')} compared (relative error median "
                f"{summary['median_rel_error']}, max {summary['max_rel_error']} ({summary['max_rel_error_tensor']}); "
                f"limit {s['limit']}), {kept}")


def count(n: int, noun: str) -> str:
    """'1 problem', '2 problems', '1 kept tensor', '0 keys': a count and its noun, plural when it is not one."""
    return f"{n:,} {noun}" + ("" if n == 1 else "s")


class VerificationFailed(PrequantError):
    """verify found problems; the message names the first one."""

    def __init__(self, report: Report, action: str = "verification failed") -> None:
        more = len(report.problems) - 1
        tail = f" (and {count(more, 'more problem')}; see the full report)" if more else ""
        super().__init__(f"{action}: {report.problems[0]}{tail}")
        self.report = report


# ------------------------------------------------------------------------------------------ files

HASH_WORKERS = 4
# The model card is the one file users edit before publishing (and the Hub's editor rewrites): it is text for
# people, no loader reads it, so a changed card is said, not failed; upload sends it as it is.
EDITED_CARD = "edited since the conversion (its sha256 differs from prequant.json); upload sends it as it is"


def check_manifest(out: Path, report: Report) -> dict | None:
    """prequant.json, read and checked (None, with the problem reported, when it cannot be)."""
    try:
        return load_manifest(out)
    except PrequantError as e:
        report.fail(e.where or MANIFEST, e.detail)
        return None


def check_files(out: Path, manifest: dict, report: Report, progress: bool) -> set[str]:
    """Each file prequant.json lists: its size first (cheap, catches truncation), then the sha256 of those whose size
    is right, hashed in parallel; files it does not list are reported. Returns the names that failed."""
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
    for rel in unlisted(out, listed):
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


# -------------------------------------------------------------------------------------- quantized


@dataclass
class Group:
    """A quantized tensor: its packed weight key, parsed quant state and the keys expected with it."""

    weight: str
    state: dict
    quant_type: str
    nested: bool
    storage: str | None = None  # safetensors dtype code of the packed weight
    complete: bool = True


def check_quantized(refs: dict[str, TensorRef], shard_of: dict[str, str], report: Report) -> dict[str, Group]:
    """Every quant state parses and has exactly its companions, with the dtypes and shapes it implies."""
    groups: dict[str, Group] = {}
    with TensorReader() as data:
        for key in sorted(k for k in refs if split_state_key(k) is not None):
            weight, quant_type = split_state_key(key)  # type: ignore[misc]
            group = _parse_state(key, refs[key], data, quant_type, report)
            if group is None:
                continue
            groups[weight] = group
            _check_companions(group, refs, shard_of, report)
    claimed = {k for g in groups.values() for k in expected_keys(g)}
    for key in refs:
        base, _, suffix = key.rpartition(".")
        if key not in claimed and suffix in COMPANIONS and base in refs and base not in groups:
            report.fail(key, f"a 4-bit companion of {base}, which has no quant state; the output is damaged, reconvert")
    report.tensors.update(
        quantized=len(groups),
        quant_types=sorted({g.quant_type for g in groups.values()}),
        double_quant=sorted({g.nested for g in groups.values()}),
    )
    return groups


def _parse_state(key: str, ref: TensorRef, data: TensorReader, quant_type: str, report: Report) -> Group | None:
    weight = split_state_key(key)[0]  # type: ignore[index]
    if ref.dtype != "U8" or len(ref.shape) != 1:
        report.fail(key, f"is {ref.dtype}{list(ref.shape)}; a quant state is 1-D U8 (JSON bytes)")
        return None
    try:
        state = decode_quant_state(data.view(ref).numpy().tobytes())
    except (ValueError, UnicodeDecodeError) as e:
        report.fail(key, f"quant state is not valid JSON ({e}); the output is damaged, reconvert")
        return None
    if not isinstance(state, dict):
        report.fail(key, "quant state is not a JSON object; the output is damaged, reconvert")
        return None
    problems = quant_state_problems(state, quant_type)
    if problems:
        report.fail(key, "quant state " + "; ".join(problems) + "; the output is damaged, reconvert")
        return None
    return Group(weight, state, quant_type, is_nested(state))


def expected_keys(g: Group) -> dict[str, tuple[tuple[str, ...], tuple[int, ...] | None]]:
    """Companion key -> (allowed dtypes, shape), as `bnb.format` lays them out; the packed weight may be stored as
    any storage dtype, and its shape depends on which (None here)."""
    layout = entries(g.weight, math.prod(g.state["shape"]), quant_type=g.quant_type, blocksize=g.state["blocksize"],
                     double_quant=g.nested, storage_code="U8")
    keys = {e.key: ((e.dtype,), e.shape) for e in layout}
    keys[g.weight] = (tuple(STORAGE_CODES.values()), None)
    return keys


def _check_companions(g: Group, refs: dict[str, TensorRef], shard_of: dict[str, str], report: Report) -> None:
    n = math.prod(g.state["shape"])
    home = shard_of.get(state_key(g.weight, g.quant_type))
    expected = expected_keys(g)
    for key, (dtypes, shape) in expected.items():
        ref = refs.get(key)
        if ref is None:
            report.fail(key, f"missing: a 4-bit tensor needs it next to its quant state ({home}); reconvert")
            g.complete = False
            continue
        if shard_of[key] != home:
            report.fail(key, f"stored in {shard_of[key]}, apart from its quant state in {home}; transformers needs them together")
        if ref.dtype not in dtypes:
            report.fail(key, f"dtype {ref.dtype}, expected {' or '.join(dtypes)}")
            g.complete = False
            continue
        if key == g.weight:
            g.storage = ref.dtype
            shape = (packed_length(n, ref.dtype), 1)
        if shape is not None and ref.shape != shape:
            report.fail(key, f"shape {list(ref.shape)}, but the quant state (shape {g.state['shape']}, blocksize "
                        f"{g.state['blocksize']}) implies {list(shape)}")
            g.complete = False
    prefix = g.weight + "."
    for key in refs:
        if key.startswith(prefix) and key not in expected:
            report.fail(key, f"unexpected key under the 4-bit tensor {g.weight}; transformers refuses unknown quant keys")


# ----------------------------------------------------------------------------------------- config


def check_config(out: Path, groups: dict[str, Group], report: Report) -> None:
    """config.json's quantization_config against the 4-bit tensors found (type, double quant, storage, skip list)."""
    before = len(report.problems)
    where = CONFIG
    try:
        config = json.loads((out / where).read_text())
    except FileNotFoundError:
        config, problem = None, "missing; a loader needs it (it is published last: the conversion did not finish)"
    except (OSError, ValueError) as e:
        config, problem = None, f"not valid JSON ({e}); reconvert"
    else:
        problem = None if isinstance(config, dict) else "not a JSON object; reconvert"
    if problem is not None:
        report.fail(where, problem)
        report.config = {"ok": False}
        return
    qc = config.get("quantization_config")
    if not isinstance(qc, dict):
        if groups:
            report.fail(where, f"has no quantization_config, but {len(groups)} tensors are 4-bit; transformers would not load them")
        report.config = {"ok": len(report.problems) == before}
        return
    expect = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    for k, v in expect.items():
        if qc.get(k) != v:
            report.fail(where, f"quantization_config.{k} is {_value(qc, k)}, expected {v!r}")
    if not groups:
        report.fail(where, "quantization_config says 4-bit, but no tensor has a 4-bit quant state")
    types = {g.quant_type for g in groups.values()}
    if len(types) > 1:
        report.fail(where, f"tensors mix quant types {sorted(types)}; one checkpoint has one bnb_4bit_quant_type")
    elif types and qc.get("bnb_4bit_quant_type") != next(iter(types)):
        report.fail(where, f"bnb_4bit_quant_type is {_value(qc, 'bnb_4bit_quant_type')} but the tensors are "
                    f"{next(iter(types))}")
    nested = {g.nested for g in groups.values()}
    if len(nested) == 1 and qc.get("bnb_4bit_use_double_quant") != next(iter(nested)):
        report.fail(where, f"bnb_4bit_use_double_quant is {_value(qc, 'bnb_4bit_use_double_quant')} but the tensors "
                    f"are {'double-quantized' if next(iter(nested)) else 'not double-quantized'}")
    storages = {g.storage for g in groups.values() if g.storage}
    want = STORAGE_CODES.get(str(qc.get("bnb_4bit_quant_storage", "uint8")))
    if want is None:
        report.fail(where, f"bnb_4bit_quant_storage {qc.get('bnb_4bit_quant_storage')!r} is not one of {', '.join(STORAGE_CODES)}")
    elif storages and storages != {want}:
        said = repr(qc.get("bnb_4bit_quant_storage", "uint8"))
        report.fail(where, f"bnb_4bit_quant_storage is {said} ({want}) but the packed weights are "
                    f"{', '.join(sorted(storages))}")
    if qc.get("bnb_4bit_compute_dtype", "float32") not in COMPUTE_NAMES:
        report.fail(where, f"bnb_4bit_compute_dtype {qc.get('bnb_4bit_compute_dtype')!r} is not one of {', '.join(COMPUTE_NAMES)}")
    skip = qc.get("llm_int8_skip_modules")
    if isinstance(skip, list):
        for weight in groups:
            module = weight.rpartition(".")[0]
            if not should_convert(module, skip):
                report.fail(weight, f"is 4-bit, but llm_int8_skip_modules matches {module}: transformers would load "
                            "the packed bytes as a plain weight")
    report.config = {"ok": len(report.problems) == before, "quantization_config": qc}


def _value(qc: dict, key: str) -> str:
    """A quantization_config entry as a report says it: its value, or that it is missing."""
    return repr(qc[key]) if key in qc else "missing"
