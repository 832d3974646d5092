"""`prequant verify`: reopen an output and prove it is what prequant wrote; gate uploads on it.

Checks, in order, each failure recorded as one line naming the file or tensor:

1. files against prequant.json: present, same size, same sha256 (hashed in parallel, large reads);
2. the index against the shards: every key where the index says, none unlisted, none twice;
3. every quantized tensor: its quant-state JSON (keys, values) and companions (present, same shard,
   dtypes and shapes implied by the state's shape and blocksize), no stray keys under it;
4. config.json's quantization_config against the tensors present;
5. with a source: each quantized tensor dequantized and compared with the original (relative L2 error
   and max error, with limits), each kept tensor byte for byte. Which tensors were quantized transposed
   (GPT-2 Conv1D) is read from prequant.json; for a manifest without that record it is decided from the
   source's architecture, as convert decides it (never guessed from shapes: square weights are ambiguous).

Everything is read through memory maps and streamed, so verifying a 165 GB output needs no more memory
than converting it.
"""

from __future__ import annotations

import json
import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

import torch

from . import architectures, metadata, reader, stats
from . import manifest as manifests
from . import source as sources
from .architectures import should_convert
from .dtypes import COMPUTE_NAMES, itemsize, torch_name
from .errors import PrequantError, UsageError
from .plan import BLOCKSIZES, NESTED_BLOCKSIZE, QUANT_TYPES, STATE_KEY_PREFIX, STORAGE_CODES
from .progress import Progress
from .source import SAFETENSORS_INDEX, SAFETENSORS_SINGLE, read_weight_map

STATE_MARK = "." + STATE_KEY_PREFIX  # between a packed weight's key and its quant type
COMPANIONS = ("absmax", "quant_map", "nested_absmax", "nested_quant_map")
# bnb_4bit_quant_storage -> safetensors code of the packed weight (dtypes.py names both).
STATE_DTYPES = ("bfloat16", "float16", "float32")
FAIL_FACTOR = 4.0  # heavy-tailed weights reach ~3x the Gaussian figure; a wrong tensor is >= 1.0
OUTLIER_FACTOR = 1.5  # above this multiple of the Gaussian figure a tensor is flagged (warning)
MAX_ERROR_RATIO = 1.0  # an element off by more than the largest block scale is not rounding
HASH_WORKERS = 4


@dataclass(frozen=True)
class Problem:
    """One finding: the file or tensor it is about, and what is wrong (with the fix when there is one)."""

    where: str
    message: str

    def __str__(self) -> str:
        return f"{self.where}: {self.message}"


@dataclass
class _Group:
    """A quantized tensor: its packed weight key, parsed quant state and the keys expected with it."""

    weight: str
    state: dict
    quant_type: str
    nested: bool
    storage: str | None = None  # safetensors dtype code of the packed weight
    complete: bool = True


@dataclass
class Report:
    """What verify found; `ok` only when there is no problem (warnings do not fail)."""

    output_dir: str
    problems: list[Problem] = field(default_factory=list)
    warnings: list[Problem] = field(default_factory=list)
    files: dict = field(default_factory=dict)
    extra_files: list[str] = field(default_factory=list)
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
        return {
            "ok": self.ok,
            "output_dir": self.output_dir,
            "problems": [vars(p) for p in self.problems],
            "warnings": [vars(p) for p in self.warnings],
            "files": self.files,
            "extra_files": self.extra_files,
            "tensors": self.tensors,
            "config": self.config,
            "conversion_stats": self.conversion_stats,
            "source": self.source,
        }

    def to_text(self) -> str:
        status = "OK" if self.ok else f"FAILED ({len(self.problems)} problem(s))"
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
                f"  tensors: {t['count']} keys in {t['shards']} shard(s), {t['quantized']} quantized "
                f"({', '.join(t['quant_types']) or '-'}), index {'consistent' if t['index_ok'] else 'INCONSISTENT'}"
            )
        if self.config:
            lines.append(f"  config.json: quantization_config {'agrees with the tensors' if self.config['ok'] else 'DISAGREES'}")
        if self.conversion_stats and self.conversion_stats.get("tensors"):
            c = self.conversion_stats
            lines.append(
                f"  recorded at conversion: relative error median {c['median_rel_error']}, max "
                f"{c['max_rel_error']} ({c['max_rel_error_tensor']})"
            )
        if self.source:
            s = self.source
            summary = s["summary"]
            worst = f", max {summary['max_rel_error']} ({summary['max_rel_error_tensor']})" if summary.get("tensors") else ""
            lines.append(
                f"  source {s['spec']}: {s['quantized']} quantized tensors compared (relative error median "
                f"{summary.get('median_rel_error', '-')}{worst}; limit {s['limit']}), {s['kept']} kept tensors compared "
                "byte for byte"
            )
        lines += [f"  FAIL {p}" for p in self.problems]
        lines += [f"  warning {p}" for p in self.warnings]
        return "\n".join(lines)


class VerificationFailed(PrequantError):
    """verify found problems; the message names the first one."""

    def __init__(self, report: Report, action: str = "verification failed") -> None:
        more = len(report.problems) - 1
        tail = f" (and {more} more problem(s); see the full report)" if more else ""
        super().__init__(f"{action}: {report.problems[0]}{tail}")
        self.report = report


def verify(
    output_dir: str | Path,
    source: str | Path | None = None,
    *,
    max_rel_error: float | None = None,
    progress: bool = True,
) -> Report:
    """Check OUTPUT_DIR (and, with `source`, its error against the original weights); never raises for
    a bad output: problems are in the returned Report. Raises UsageError when OUTPUT_DIR is not a folder."""
    out = Path(output_dir)
    if not out.is_dir():
        raise UsageError(f"OUTPUT_DIR {out} is not a directory; pass the folder prequant convert wrote")
    report = Report(str(out))
    bad_files: set[str] = set()
    manifest = _check_manifest(out, report)
    if manifest is not None:
        bad_files = _check_files(out, manifest, report, progress)
        report.conversion_stats = (manifest.get("stats") or {}).get("summary")
    refs, shard_of = _check_shards(out, report, bad_files)
    groups = _check_quantized(refs, shard_of, report)
    _check_config(out, groups, report)
    if source is not None:
        transposed = manifest.get("transposed") if manifest is not None else None
        _compare_source(str(source), refs, groups, report, max_rel_error, progress, transposed)
    return report


# ------------------------------------------------------------------------------------------ files


def _check_manifest(out: Path, report: Report) -> dict | None:
    try:
        return manifests.load(out)
    except PrequantError as e:
        where, _, message = e.message.partition(": ")
        report.fail(where, message)
        return None


def _check_files(out: Path, manifest: dict, report: Report, progress: bool) -> set[str]:
    """Sizes first (cheap, catches truncation), then sha256 of the files whose size is right."""
    listed: dict[str, dict] = manifest["files"]
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
        elif (size := path.stat().st_size) != entry["size"]:
            report.fail(
                name, f"{size:,} bytes but prequant.json says {entry['size']:,}: the file was truncated, edited or replaced"
            )
            bad.add(name)
        else:
            to_hash.append((name, path, entry["sha256"]))
    total = sum(listed[name]["size"] for name, _, _ in to_hash)
    with Progress(total, enabled=progress, label="hashing") as bar, ThreadPoolExecutor(
        max_workers=max(1, min(HASH_WORKERS, os.cpu_count() or 1)), thread_name_prefix="prequant-verify"
    ) as pool:
        digests = pool.map(lambda item: manifests.sha256_file(item[1], bar.advance), to_hash)
        for (name, _, expected), digest in zip(to_hash, digests):
            if digest != expected:
                report.fail(name, "sha256 differs from prequant.json: the file was modified or corrupted; "
                            "re-download it or reconvert")
                bad.add(name)
    for path in sorted(out.rglob("*")):
        rel = path.relative_to(out).as_posix()
        if path.is_file() and rel not in listed and rel != manifests.MANIFEST:
            report.extra_files.append(rel)
            if rel.endswith((".safetensors", ".bin")) or rel in ("config.json", SAFETENSORS_INDEX):
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


def _check_shards(
    out: Path, report: Report, bad_files: set[str]
) -> tuple[dict[str, reader.TensorRef], dict[str, str]]:
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
    refs: dict[str, reader.TensorRef] = {}
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
            tensors, metadata = reader.read_header(path)
        except PrequantError as e:
            report.fail(name, e.message.removeprefix(f"{path}: "))
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
        report.fail(SAFETENSORS_INDEX, e.message.removeprefix(f"{path}: "))
        return None


# -------------------------------------------------------------------------------------- quantized


def _check_quantized(refs: dict[str, reader.TensorRef], shard_of: dict[str, str], report: Report) -> dict[str, _Group]:
    """Every quant state parses and has exactly its companions, with the dtypes and shapes it implies."""
    groups: dict[str, _Group] = {}
    with reader.TensorSource() as data:
        for key in sorted(k for k in refs if STATE_MARK in k):
            weight, _, quant_type = key.partition(STATE_MARK)
            group = _parse_state(key, refs[key], data, quant_type, report)
            if group is None:
                continue
            groups[weight] = group
            _check_companions(group, refs, shard_of, report)
    claimed = {k for g in groups.values() for k in _expected_keys(g)}
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


def _parse_state(key: str, ref: reader.TensorRef, data: reader.TensorSource, quant_type: str, report: Report) -> _Group | None:
    weight = key.partition(STATE_MARK)[0]
    if ref.dtype != "U8" or len(ref.shape) != 1:
        report.fail(key, f"is {ref.dtype}{list(ref.shape)}; a quant state is 1-D U8 (JSON bytes)")
        return None
    try:
        state = json.loads(data.view(ref).numpy().tobytes())
    except (ValueError, UnicodeDecodeError) as e:
        report.fail(key, f"quant state is not valid JSON ({e}); the output is damaged, reconvert")
        return None
    if not isinstance(state, dict):
        report.fail(key, "quant state is not a JSON object; the output is damaged, reconvert")
        return None
    nested = "nested_blocksize" in state or "nested_offset" in state
    required = {"quant_type", "blocksize", "dtype", "shape"}
    if nested:
        required |= {"nested_blocksize", "nested_dtype", "nested_offset"}
    missing = sorted(required - state.keys())
    unknown = sorted(state.keys() - required)
    problems = []
    if missing:
        problems.append(f"lacks {', '.join(missing)}")
    if unknown:
        problems.append(f"has unexpected {', '.join(unknown)}")
    if quant_type not in QUANT_TYPES or state.get("quant_type") != quant_type:
        problems.append(f"quant_type {state.get('quant_type')!r} does not match the key's __{quant_type}")
    if state.get("blocksize") not in BLOCKSIZES:
        problems.append(f"blocksize {state.get('blocksize')!r} is not one of {BLOCKSIZES}")
    if state.get("dtype") not in STATE_DTYPES:
        problems.append(f"dtype {state.get('dtype')!r} is not one of {', '.join(STATE_DTYPES)}")
    shape = state.get("shape")
    if not isinstance(shape, list) or not shape or not all(isinstance(d, int) and d > 0 for d in shape):
        problems.append(f"shape {shape!r} is not a list of positive integers")
    if nested:
        if state.get("nested_blocksize") != NESTED_BLOCKSIZE:
            problems.append(f"nested_blocksize {state.get('nested_blocksize')!r} is not {NESTED_BLOCKSIZE}")
        if state.get("nested_dtype") != "float32":
            problems.append(f"nested_dtype {state.get('nested_dtype')!r} is not 'float32'")
        offset = state.get("nested_offset")
        if not isinstance(offset, (int, float)) or isinstance(offset, bool) or not math.isfinite(offset):
            problems.append(f"nested_offset {offset!r} is not a finite number")
    if problems:
        report.fail(key, "quant state " + "; ".join(problems) + "; the output is damaged, reconvert")
        return None
    return _Group(weight, state, quant_type, nested)


def _expected_keys(g: _Group) -> dict[str, tuple[tuple[str, ...], tuple[int, ...] | None]]:
    """Companion key -> (allowed dtypes, shape); the packed weight's shape depends on its dtype (None)."""
    n = math.prod(g.state["shape"])
    blocks = -(-n // g.state["blocksize"])
    keys: dict[str, tuple[tuple[str, ...], tuple[int, ...] | None]] = {
        g.weight: (tuple(STORAGE_CODES.values()), None),
        f"{g.weight}.absmax": (("U8",) if g.nested else ("F32",), (blocks,)),
        f"{g.weight}.quant_map": (("F32",), (16,)),
    }
    if g.nested:
        keys[f"{g.weight}.nested_absmax"] = (("F32",), (-(-blocks // NESTED_BLOCKSIZE),))
        keys[f"{g.weight}.nested_quant_map"] = (("F32",), (256,))
    keys[f"{g.weight}{STATE_MARK}{g.quant_type}"] = (("U8",), None)
    return keys


def _check_companions(g: _Group, refs: dict[str, reader.TensorRef], shard_of: dict[str, str], report: Report) -> None:
    n = math.prod(g.state["shape"])
    home = shard_of.get(f"{g.weight}{STATE_MARK}{g.quant_type}")
    expected = _expected_keys(g)
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
            # bitsandbytes stores (n + 1) // (2 * itemsize) elements of the storage dtype, as [count, 1].
            shape = ((n + 1) // (2 * itemsize(ref.dtype)), 1)
        if shape is not None and ref.shape != shape:
            report.fail(key, f"shape {list(ref.shape)}, but the quant state (shape {g.state['shape']}, blocksize "
                        f"{g.state['blocksize']}) implies {list(shape)}")
            g.complete = False
    prefix = g.weight + "."
    for key in refs:
        if key.startswith(prefix) and key not in expected:
            report.fail(key, f"unexpected key under the 4-bit tensor {g.weight}; transformers refuses unknown quant keys")


# ----------------------------------------------------------------------------------------- config


def _check_config(out: Path, groups: dict[str, _Group], report: Report) -> None:
    before = len(report.problems)
    where = "config.json"
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
            report.fail(where, f"quantization_config.{k} is {qc.get(k)!r}, expected {v!r}")
    if not groups:
        report.fail(where, "quantization_config says 4-bit, but no tensor has a 4-bit quant state")
    types = {g.quant_type for g in groups.values()}
    if len(types) > 1:
        report.fail(where, f"tensors mix quant types {sorted(types)}; one checkpoint has one bnb_4bit_quant_type")
    elif types and qc.get("bnb_4bit_quant_type") != next(iter(types)):
        report.fail(where, f"bnb_4bit_quant_type is {qc.get('bnb_4bit_quant_type')!r} but the tensors are {next(iter(types))}")
    nested = {g.nested for g in groups.values()}
    if len(nested) == 1 and qc.get("bnb_4bit_use_double_quant") != next(iter(nested)):
        report.fail(where, f"bnb_4bit_use_double_quant is {qc.get('bnb_4bit_use_double_quant')!r} but the tensors "
                    f"are {'double-quantized' if next(iter(nested)) else 'not double-quantized'}")
    storages = {g.storage for g in groups.values() if g.storage}
    want = STORAGE_CODES.get(str(qc.get("bnb_4bit_quant_storage", "uint8")))
    if want is None:
        report.fail(where, f"bnb_4bit_quant_storage {qc.get('bnb_4bit_quant_storage')!r} is not one of {', '.join(STORAGE_CODES)}")
    elif storages and storages != {want}:
        report.fail(where, f"bnb_4bit_quant_storage is {qc.get('bnb_4bit_quant_storage')!r} ({want}) but the packed "
                    f"weights are {', '.join(sorted(storages))}")
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


# ----------------------------------------------------------------------------------------- source


def _compare_source(
    spec: str,
    refs: dict[str, reader.TensorRef],
    groups: dict[str, _Group],
    report: Report,
    max_rel_error: float | None,
    progress: bool,
    transposed: list[str] | None,
) -> None:
    """`transposed`: prequant.json's record of the tensors quantized transposed (None when it has none)."""
    src = sources.resolve(spec)
    src_refs = reader.scan(src.weight_files)
    if transposed is None:
        transposed = _transposed_by_architecture(src, src_refs, report)
        if transposed is None:
            return
    transposed_set = set(transposed)
    per_tensor: dict[str, stats.TensorStats] = {}
    limits: set[float] = set()
    kept = 0
    accounted: set[str] = set()
    with reader.TensorSource() as sdata, reader.TensorSource() as odata, Progress(
        sum(t.nbytes for t in src_refs), enabled=progress, label="comparing"
    ) as bar:
        for t in src_refs:
            bar.advance(t.nbytes)
            group = groups.get(t.name)
            if group is not None:
                accounted.update(_expected_keys(group))
                if not group.complete:
                    continue  # already reported; its bytes cannot be interpreted
                st = _compare_quantized(t, group, t.name in transposed_set, sdata, odata, refs, report)
                if st is None:
                    continue
                per_tensor[t.name] = st
                expected = stats.expected_rel_error(group.quant_type, group.state["blocksize"])
                limit = max_rel_error if max_rel_error is not None else round(FAIL_FACTOR * expected, 3)
                limits.add(limit)
                _judge(t.name, st, expected, limit, report)
            elif t.name in refs:
                accounted.add(t.name)
                kept += 1
                out = refs[t.name]
                if (out.dtype, out.shape) != (t.dtype, t.shape):
                    report.fail(t.name, f"is {out.dtype}{list(out.shape)} but the source has {t.dtype}{list(t.shape)}")
                elif not torch.equal(_bytes(odata, out), _bytes(sdata, t)):
                    report.fail(t.name, "kept unquantized, but its bytes differ from the source")
            else:
                report.fail(t.name, "in the source but not in the output")
    src_names = {t.name for t in src_refs}
    for key in sorted(set(refs) - accounted - src_names):
        report.fail(key, "in the output but not in the source (was it converted from another checkpoint?)")
    report.source = {
        "spec": spec,
        "quantized": len(per_tensor),
        "kept": kept,
        "limit": max(limits) if limits else max_rel_error,
        "summary": stats.summarize(per_tensor),
        "tensors": {name: st.to_dict() | {"error_ratio": round(st.error_ratio, 6)} for name, st in per_tensor.items()},
    }


def _transposed_by_architecture(
    src: sources.Source, src_refs: list[reader.TensorRef], report: Report
) -> list[str] | None:
    """For a manifest that predates the record (or none): the tensors convert quantizes transposed, from the
    same architecture analysis (remote code is never run); None, with the problem reported, if it cannot tell.
    The skip list only removes tensors from quantization, never changes how one is laid out: none is needed."""
    try:
        layout = architectures.analyze(metadata.read_config(src.path), src.path, src_refs, [])
    except PrequantError as e:
        report.fail(manifests.MANIFEST, f"does not record which tensors were quantized transposed, and the source's "
                    f"architecture cannot tell ({e.message}); the source cannot be compared")
        return None
    return [name for name, decision in layout.decisions.items() if decision.transpose]


def _compare_quantized(
    t: reader.TensorRef,
    g: _Group,
    transpose: bool,
    sdata: reader.TensorSource,
    odata: reader.TensorSource,
    refs: dict[str, reader.TensorRef],
    report: Report,
) -> stats.TensorStats | None:
    shape = tuple(g.state["shape"])
    x = sdata.view(t)
    if transpose:  # GPT-2 Conv1D weights are stored [in, out] and quantized transposed
        if x.dim() != 2:
            report.fail(t.name, f"recorded as quantized transposed, but the source's is {x.dim()}-D {list(t.shape)}")
            return None
        x = x.t()
    if tuple(x.shape) != shape:
        layout = " (transposed, as it was quantized)" if transpose else ""
        report.fail(t.name, f"quant state shape {list(shape)} does not match the source's {list(x.shape)}{layout}")
        return None
    if torch_name(x.dtype) != g.state["dtype"]:
        report.fail(t.name, f"quant state dtype {g.state['dtype']} but the source is {torch_name(x.dtype)}")
        return None
    w = g.weight
    absmax = stats.dequantize_absmax(
        odata.view(refs[f"{w}.absmax"]),
        odata.view(refs[f"{w}.nested_absmax"]) if g.nested else None,
        odata.view(refs[f"{w}.nested_quant_map"]) if g.nested else None,
        g.state.get("nested_offset", 0.0),
    )
    return stats.compare(x, odata.view(refs[w]), absmax, odata.view(refs[f"{w}.quant_map"]), g.state["blocksize"])


def _judge(name: str, st: stats.TensorStats, expected: float, limit: float, report: Report) -> None:
    if not st.finite:
        report.fail(name, "dequantizes to NaN or Inf; the 4-bit data or its scales are damaged, reconvert")
    elif st.rel_error > limit:
        report.fail(name, f"relative error {st.rel_error:.4f} exceeds the limit {limit} (expected about "
                    f"{expected}); the 4-bit data does not match the source")
    elif st.error_ratio > MAX_ERROR_RATIO:
        report.fail(name, f"an element is off by {st.max_abs_error:.4g}, more than the largest block scale "
                    f"{st.absmax_max:.4g}: not 4-bit rounding, the data is damaged")
    elif st.rel_error > OUTLIER_FACTOR * expected:
        report.warn(name, f"relative error {st.rel_error:.4f} is an outlier (about {expected} expected for "
                    "Gaussian-like weights): heavy-tailed weights; consider --skip for this module")


def _bytes(data: reader.TensorSource, ref: reader.TensorRef) -> torch.Tensor:
    return data.view(ref).reshape(-1).view(torch.uint8)


# ----------------------------------------------------------------------------------------- upload


def upload(
    output_dir: str | Path,
    repo_id: str,
    *,
    revision: str | None = None,
    private: bool = False,
    commit_message: str | None = None,
    token: str | None = None,
    progress: bool = True,
) -> dict:
    """Verify OUTPUT_DIR, then upload it to the Hub (create_repo + upload_folder); return what was sent.

    Refuses (VerificationFailed, nothing sent) when verification finds a problem, and when OUTPUT_DIR
    holds files that are not part of the conversion (they would be published too)."""
    from . import hub

    out = Path(output_dir)
    report = verify(out, progress=progress)
    if not report.ok:
        raise VerificationFailed(report, f"refusing to upload {out}, it does not verify")
    if report.extra_files:
        extra = report.extra_files
        more = f" and {len(extra) - 1} more" if len(extra) > 1 else ""
        raise PrequantError(
            f"refusing to upload {out}: {extra[0]}{more} is not part of the conversion (not in prequant.json) and "
            "would be published too; move it out of OUTPUT_DIR"
        )
    files = sorted(manifests.load(out)["files"]) + [manifests.MANIFEST]
    url = hub.upload(out, repo_id, revision=revision, private=private, commit_message=commit_message, token=token)
    return {
        "repo_id": repo_id,
        "revision": revision,
        "private": private,
        "commit_url": url,
        "files": sorted(files),
        "bytes": sum((out / f).stat().st_size for f in files),
        "verified": True,
    }


def push_converted(output_dir: Path, repo_id: str, *, progress: bool = True) -> str:
    """convert --push-to-hub: verify and upload a fresh output; return the commit URL. A failure says the
    conversion itself is complete, so only the upload needs redoing."""
    try:
        return upload(output_dir, repo_id, progress=progress)["commit_url"]
    except PrequantError as e:
        error = PrequantError(
            f"{e.message} (the conversion itself is complete in {output_dir}; once fixed, run "
            f"`prequant upload {output_dir} {repo_id}`)"
        )
        error.exit_code = e.exit_code
        raise error from e
