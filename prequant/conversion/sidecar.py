"""The output's side of the checkpoint: config.json with its quantization_config, the index, and the source's
other files carried over (tokenizer, generation config, templates, code, licence)."""

from __future__ import annotations

import shutil
from pathlib import Path

from ..bnb.format import quantization_config
from ..checkpoint.hf_files import CARD, CONFIG, INDEX_NAMES, SAFETENSORS_INDEX, WEIGHT_SUFFIXES
from ..checkpoint.manifest import MANIFEST
from ..errors import PrequantError
from ..util.fsio import write_error, write_json
from .plan import Plan


def write_config(staging: Path, config: dict, plan: Plan) -> None:
    """config.json: the source's, plus quantization_config."""
    qc = quantization_config(plan.settings, plan.skip_modules)
    write_json(staging / CONFIG, {**config, "quantization_config": qc})


def write_index(staging: Path, plan: Plan, shard_sizes: dict[str, int]) -> None:
    """model.safetensors.index.json listing every key, when there is more than one shard."""
    if len(plan.shards) == 1:
        return
    weight_map = {o.key: s.shard for s in plan.steps for o in s.outputs}
    index = {"metadata": {"total_size": sum(shard_sizes.values())}, "weight_map": dict(sorted(weight_map.items()))}
    write_json(staging / SAFETENSORS_INDEX, index, sort_keys=False)


def side_files(source_dir: Path) -> list[Path]:
    """Files of the source to carry over (tokenizer, generation config, templates, code, licence), relative.
    Not its weights, index, config, manifest or card: the output has its own (the card carries the original)."""
    found = []
    for path in sorted(source_dir.rglob("*")):
        rel = path.relative_to(source_dir)
        if any(part.startswith(".") for part in rel.parts) or not path.is_file():
            continue  # .git, .cache (the Hub's download metadata), editor files
        if rel.suffix in WEIGHT_SUFFIXES or rel.name in INDEX_NAMES or rel.as_posix() in (CONFIG, MANIFEST, CARD):
            continue
        found.append(rel)
    return found


def copy_side_files(source_dir: Path, staging: Path, files: list[Path]) -> None:
    """Copy `side_files(source_dir)` into the staging folder, keeping their relative paths."""
    for rel in files:
        try:
            (staging / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source_dir / rel, staging / rel)
        except OSError as e:
            # Opening the source's file failed (only then is filename2 unset: shutil's sendfile path names
            # both files on a failed write), or writing the copy did: say which, and what to do.
            if e.filename == str(source_dir / rel) and e.filename2 is None:
                raise PrequantError(
                    f"cannot read it ({e.strerror or e}); make it readable, or move it out of the source directory",
                    where=source_dir / rel,
                ) from e
            raise write_error(staging / rel, e) from e
