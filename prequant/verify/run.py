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

import math
from pathlib import Path

from ..errors import UsageError
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
    a bad output: problems are in the returned Report. Raises UsageError when OUTPUT_DIR is not a folder."""
    out = Path(output_dir)
    if max_rel_error is not None and not (math.isfinite(max_rel_error) and max_rel_error > 0):
        raise UsageError(f"--max-rel-error {max_rel_error} must be a number above 0 (a relative L2 error, e.g. 0.2)")
    if not out.is_dir():
        raise UsageError(f"OUTPUT_DIR {out} is not a directory; pass the folder prequant convert wrote")
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
