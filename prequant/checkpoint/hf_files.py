"""The files of a Hugging Face checkpoint: their names, the index's weight_map, and config.json.

Standard library only: the CLI lists a source's weight files with it before torch is imported."""

from __future__ import annotations

import json
from collections.abc import Collection
from pathlib import Path

from ..errors import PrequantError
from . import quantized
from .tensors import TensorRef, quote

CONFIG = "config.json"
CARD = "README.md"  # a repo's model card
SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"
BIN_INDEX = "pytorch_model.bin.index.json"
BIN_SINGLE = "pytorch_model.bin"
WEIGHT_LAYOUTS = ((SAFETENSORS_INDEX, SAFETENSORS_SINGLE, "safetensors"), (BIN_INDEX, BIN_SINGLE, "bin"))
INDEX_NAMES = (SAFETENSORS_INDEX, BIN_INDEX)
# The files peft's save_pretrained writes: an adapter's, never a model's (copied as side files, adapter_config.json
# makes transformers take the model for an adapter).
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_FILES = (ADAPTER_CONFIG, "adapter_model.safetensors", "adapter_model.bin")
# Weight formats: never copied as side files (the output has its own weights, and copies of the originals,
# e.g. Llama's original/consolidated.00.pth, would double the output for nothing).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".onnx", ".npz")


def cache_repo_dir(path: str | Path) -> Path | None:
    """The repo folder of the Hugging Face cache snapshot that `path` names (`<cache>/models--org--name/snapshots/
    <commit>`: a folder named snapshots inside one named models--...), else None. A folder named snapshots elsewhere
    is no snapshot: its parent's blobs/ is nothing the Hub put there."""
    parts = Path(path).absolute().parts
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        return Path(*parts[:-2])
    return None


def weight_layout(names: Collection[str]) -> tuple[str | None, str, str] | None:
    """Which weights a checkpoint whose files are `names` holds: (its index, or None for a single file; the single
    file's name; the format), from the first of WEIGHT_LAYOUTS whose index or single file is among them (a Hub
    listing: the conversion and the CLI's early download must pick the same); None without weights."""
    for index, single, fmt in WEIGHT_LAYOUTS:
        if index in names or single in names:
            return (index if index in names else None), single, fmt
    return None


def shard_name(i: int, count: int) -> str:
    """transformers' file names: model.safetensors alone, model-00001-of-00003.safetensors when sharded."""
    return SAFETENSORS_SINGLE if count == 1 else f"model-{i + 1:05d}-of-{count:05d}.safetensors"


def read_weight_map(index: Path) -> dict[str, str]:
    """An index's weight_map (tensor name -> shard file name), checked to be one."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise TypeError("weight_map must map tensor names to file names")
    except PermissionError as e:
        raise PrequantError("permission denied; make it readable", where=index) from e
    except (OSError, ValueError, KeyError, TypeError, IndexError, RecursionError) as e:
        reason = " ".join(str(e).split())[:120] or type(e).__name__
        raise PrequantError(f"not a valid index (needs a 'weight_map' object: {reason}); re-download it", where=index) from e
    return weight_map


def shard_names(root: object, index: Path) -> list[str]:
    """The shard file names an index's weight_map names, sorted as transformers loads them (`model-00001-of-...`
    first: a sorted weight_map names the last shard first, for lm_head); each a plain file name."""
    weight_map = read_weight_map(index)
    files: dict[str, None] = {}
    for filename in weight_map.values():
        if filename in files:
            continue
        # An index is data from the internet: a name like "../../etc/passwd" must not make us read
        # (or later delete) anything outside the checkpoint directory. The check is on the name, not on
        # the resolved path: the Hub cache's snapshot folders hold symlinks into ../../blobs, and links the
        # user put in their own directory are theirs to make.
        if not _plain_file_name(filename):
            raise PrequantError(
                f"shard name {filename[:200]!r} points outside {root}; refusing to read it, fix the index's "
                "weight_map (shard names are plain file names)",
                where=index.name,
            )
        files[filename] = None
    if not files:
        raise PrequantError("the index lists no tensors; re-download it", where=index)
    return sorted(files)


def _plain_file_name(name: str) -> bool:
    """A bare file name: no directory part (either separator), not '.' or '..', no NUL byte."""
    return bool(name) and name not in (".", "..") and not any(c in name for c in "/\\\0")


def check_index(index_path: Path, tensors: list[TensorRef]) -> None:
    """Check a `*.index.json` weight_map against the tensors actually found in the shards."""
    weight_map = read_weight_map(index_path)
    found = {t.name: t.file.name for t in tensors}
    for name, filename in weight_map.items():
        if name not in found:
            raise PrequantError(
                f"tensor {quote(name)} is listed in {quote(filename)} but no shard holds it; the download is "
                "incomplete, re-download the missing shard",
                where=index_path.name,
            )
        if Path(filename).name != found[name]:
            raise PrequantError(
                f"tensor {quote(name)} is listed in {quote(filename)} but found in {found[name]}; the index and the "
                "shards disagree, re-download the checkpoint",
                where=index_path.name,
            )


def read_config(source_dir: Path) -> dict:
    """The source's config.json, which must exist, be a JSON object, and not be quantized already (FP8 aside:
    `quantized.as_16bit` reads it as the 16-bit checkpoint it stands for)."""
    path = source_dir / CONFIG
    if not path.is_file():
        raise PrequantError(
            "config.json is missing; put the model's config.json next to its weights (a Hugging Face checkpoint "
            "needs one)",
            where=source_dir,
        )
    try:
        config = json.loads(path.read_text())
    except PermissionError as e:
        raise PrequantError("permission denied; make it readable", where=path) from e
    except (OSError, ValueError, RecursionError) as e:
        raise PrequantError(f"not valid JSON ({e}); fix or re-download it", where=path) from e
    if not isinstance(config, dict):
        raise PrequantError("not a JSON object; fix or re-download it", where=path)
    if "quantization_config" in config and not quantized.declared(config["quantization_config"]):
        qc = config["quantization_config"]
        method = quantized.described(qc)
        again = " (to store a prequant output's packed weights as another dtype: prequant change-storage)"
        unread = f", a format prequant does not dequantize (it reads {quantized.READ})"
        unread = "" if method == "bitsandbytes" else unread
        raise PrequantError(
            f"the source is already quantized ({method}){unread}; convert the original bf16/fp16/fp32 checkpoint"
            + (again if method == "bitsandbytes" else ""), where=path
        )
    return config
