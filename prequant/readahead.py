"""Start reading the source from the disk before the heavy imports (torch, CUDA, transformers) finish.

A conversion is bound by the disk, and a cold start spends a few seconds importing libraries while the
disk sits idle. This asks the kernel to read the first gigabytes of the source into the page cache in
the background, using only the standard library, so those seconds overlap. Purely advisory: any
problem here is ignored, and the real checks happen later in source.py and reader.py.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

EARLY_BYTES = 2 * 1024**3
_STEP = 64 * 1024 * 1024


def start(source: str, limit: int = EARLY_BYTES) -> None:
    """Begin background readahead of the first `limit` bytes of a local checkpoint's weight files."""
    try:
        path = Path(source)
        if path.is_dir() and hasattr(os, "posix_fadvise"):
            threading.Thread(target=_advise, args=(_weight_files(path), limit), daemon=True).start()
    except Exception:  # noqa: BLE001 - advisory only
        pass


def _weight_files(path: Path) -> list[Path]:
    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if (path / index).is_file():
            names = dict.fromkeys(json.loads((path / index).read_text())["weight_map"].values())
            return [path / n for n in names if "/" not in n and n not in (".", "..")]
    return [p for p in (path / "model.safetensors", path / "pytorch_model.bin") if p.is_file()]


def _advise(files: list[Path], limit: int) -> None:
    try:
        for file in files:
            fd = os.open(file, os.O_RDONLY)
            try:
                size = min(os.fstat(fd).st_size, limit)
                for offset in range(0, size, _STEP):
                    os.posix_fadvise(fd, offset, min(_STEP, size - offset), os.POSIX_FADV_WILLNEED)
                limit -= size
            finally:
                os.close(fd)
            if limit <= 0:
                return
    except Exception:  # noqa: BLE001 - advisory only
        pass
