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

1 and 2 are here; 3 and 4 in verify_tensors.py; 5 in compare.py. The upload that verify gates is in publish.py.

Everything is read through memory maps and streamed, so verifying a 165 GB output needs no more memory
than converting it.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from . import manifest as manifests
from . import reader
from .compare import compare_source
from .errors import PrequantError, UsageError
from .progress import Progress
from .source import SAFETENSORS_INDEX, SAFETENSORS_SINGLE, read_weight_map
from .verify_tensors import check_config, check_quantized

HASH_WORKERS = 4


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
    groups = check_quantized(refs, shard_of, report)
    check_config(out, groups, report)
    if source is not None:
        transposed = manifest.get("transposed") if manifest is not None else None
        compare_source(str(source), refs, groups, report, max_rel_error, progress, transposed)
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
