"""The files of a folder peft's `save_pretrained` writes, known without torch: `adapter` reads them, and the CLI
peeks at a local one before the libraries load, to read it and its base ahead (`conversion.readahead.prefetch`)."""

from __future__ import annotations

import json
from pathlib import Path

CONFIG_NAME = "adapter_config.json"
WEIGHT_NAMES = ("adapter_model.safetensors", "adapter_model.bin")  # peft writes one; the first found is read


def peek(spec: str) -> tuple[list[Path], str | None]:
    """A local adapter folder's weight file and the base its config names (base_model_name_or_path); nothing
    for anything else. Advisory: whatever is wrong with the folder is for `adapter.read` to report."""
    path = Path(spec).expanduser()
    try:
        weights = [path / n for n in WEIGHT_NAMES if (path / n).is_file()][:1]
        config = json.loads((path / CONFIG_NAME).read_text())
        base = config.get("base_model_name_or_path") if isinstance(config, dict) else None
        return weights, base if isinstance(base, str) else None
    except (OSError, ValueError):
        return [], None
