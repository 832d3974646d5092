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

1 and 2 are `files`'; 3 and 4 `tensors`'; 5 `compare`'s; they file what they find in a `report.Report`. The
upload that verify gates is in `publish`.

Everything is read through memory maps and streamed, so verifying a 165 GB output needs no more memory
than converting it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from ..checkpoint.hf_files import CONFIG
from ..checkpoint.manifest import MANIFEST
from ..errors import PrequantError, UsageError
from .compare import compare_source
from .files import check_files, check_manifest, check_shards
from .report import Report
from .tensors import check_config, check_quantized


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


def check_arguments(source: str | Path | None, max_rel_error: float | None, *, cli: bool = False) -> None:
    """Refuse arguments that cannot mean anything (UsageError), naming them as the caller wrote them: the CLI's
    flags when `cli`, else the keyword arguments."""
    if max_rel_error is None:
        return
    limit = f"--max-rel-error {max_rel_error}" if cli else f"max_rel_error={max_rel_error!r}"
    if source is None:
        needs = "--source SOURCE" if cli else "source="
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
