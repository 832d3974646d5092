"""`prequant verify`: reopen an output and prove it is what prequant wrote, checking it on its own (`check`) and,
with a source, against the original weights (`compare`). Everything is read through memory maps and streamed, so
verifying an output needs no more memory than converting it."""

from __future__ import annotations

import json
import math
from pathlib import Path

from ..checkpoint.hf_files import CONFIG
from ..checkpoint.manifest import MANIFEST
from ..errors import PrequantError, UsageError, on_command_line, spelled
from .check import Report, check_config, check_files, check_manifest, check_quantized, check_shards
from .compare import compare_source


def verify(
    output_dir: str | Path,
    source: str | Path | None = None,
    *,
    max_rel_error: float | None = None,
    progress: bool = True,
) -> Report:
    """Check OUTPUT_DIR (and, with `source`, its error against the original weights); never raises for
    a bad output: problems are in the returned Report. Raises UsageError when OUTPUT_DIR is not a folder or
    `max_rel_error` is given without `source` (or is not above 0), PrequantError when the folder is not a
    prequant output at all (neither prequant.json nor a 4-bit config.json)."""
    check_arguments(source, max_rel_error)
    out = Path(output_dir)
    if not out.is_dir():
        raise UsageError(f"OUTPUT_DIR {out} is not a directory; pass the folder prequant convert wrote")
    if not (out / MANIFEST).is_file() and not _quantized_config(out):
        raise PrequantError(f"OUTPUT_DIR {out} is not a prequant output: it has no {MANIFEST}, and no {CONFIG} with a "
                            "quantization_config; pass the folder prequant convert wrote")
    report = Report(str(out))
    bad_files: set[str] = set()
    manifest = check_manifest(out, report)
    if manifest is not None:
        bad_files = check_files(out, manifest, report, progress)
        report.conversion_stats = (manifest.get("stats") or {}).get("summary")
    refs, shard_of = check_shards(out, report, bad_files)
    groups = check_quantized(refs, shard_of, report)
    check_config(out, groups, report)
    if source is not None:
        transposed = manifest.get("transposed") if manifest is not None else None
        compare_source(str(source), refs, groups, report, max_rel_error, progress, transposed)
    return report


def check_arguments(source: str | Path | None, max_rel_error: float | None) -> None:
    """Refuse arguments that cannot mean anything (UsageError), naming them as the caller wrote them: the CLI's
    flags or the keyword arguments."""
    if max_rel_error is None:
        return
    limit = spelled("max_rel_error", max_rel_error)
    if source is None:
        needs = "--source SOURCE" if on_command_line() else "source="
        raise UsageError(f"{limit} limits each tensor's error against the original weights, which only {needs} "
                         "compares; pass the source too, or leave the limit out")
    number = isinstance(max_rel_error, (int, float)) and not isinstance(max_rel_error, bool)
    if not (number and math.isfinite(max_rel_error) and max_rel_error > 0):
        raise UsageError(f"{limit} must be a number above 0 (a relative L2 error, e.g. 0.2)")


def _quantized_config(out: Path) -> bool:
    """Whether OUTPUT_DIR's config.json has a quantization_config (a 4-bit checkpoint whose prequant.json is
    missing is verified, and fails on that; a plain model folder is not a prequant output at all)."""
    try:
        config = json.loads((out / CONFIG).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and "quantization_config" in config
