"""config.json with its quantization_config, and the source's other files carried over."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from .errors import PrequantError
from .source import BIN_INDEX, SAFETENSORS_INDEX
from .plan import Plan, Settings
from .writer import write_error, write_json

# Weight formats never copied as side files: the output has its own weights, and copies of the
# originals (e.g. Llama's original/consolidated.00.pth) would double the output for nothing.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".onnx", ".npz")
INDEX_NAMES = (SAFETENSORS_INDEX, BIN_INDEX)
MANIFEST = "prequant.json"
CARD = "README.md"  # the output gets its own model card (prequant.card), carrying the original


def read_config(source_dir: Path) -> dict:
    """The source's config.json, which must exist and be a JSON object."""
    path = source_dir / "config.json"
    if not path.is_file():
        raise PrequantError(
            f"{source_dir}: config.json is missing; put the model's config.json next to its weights (a Hugging Face "
            "checkpoint needs one)"
        )
    try:
        config = json.loads(path.read_text())
    except PermissionError as e:
        raise PrequantError(f"{path}: permission denied; make it readable") from e
    except (OSError, ValueError, RecursionError) as e:
        raise PrequantError(f"{path}: not valid JSON ({e}); fix or re-download it") from e
    if not isinstance(config, dict):
        raise PrequantError(f"{path}: not a JSON object; fix or re-download it")
    if "quantization_config" in config:
        method = config["quantization_config"].get("quant_method", "?") if isinstance(config["quantization_config"], dict) else "?"
        raise PrequantError(
            f"{path}: the source is already quantized ({method}); convert the original bf16/fp16/fp32 checkpoint"
        )
    return config


def quantization_config(settings: Settings, skip_modules: list[str] | None) -> dict:
    """The quantization_config transformers writes for BitsAndBytesConfig with these settings."""
    return {
        "_load_in_4bit": True,
        "_load_in_8bit": False,
        "bnb_4bit_compute_dtype": settings.compute_dtype,
        "bnb_4bit_quant_storage": settings.quant_storage,
        "bnb_4bit_quant_type": settings.quant_type,
        "bnb_4bit_use_double_quant": settings.double_quant,
        "llm_int8_enable_fp32_cpu_offload": False,
        "llm_int8_has_fp16_weight": False,
        "llm_int8_skip_modules": skip_modules,
        "llm_int8_threshold": 6.0,
        "load_in_4bit": True,
        "load_in_8bit": False,
        "quant_method": "bitsandbytes",
    }


def write_config(staging: Path, config: dict, plan: Plan) -> None:
    """config.json: the source's, plus quantization_config."""
    write_json(staging / "config.json", {**config, "quantization_config": quantization_config(plan.settings, plan.skip_modules)})


def write_index(staging: Path, plan: Plan, shard_sizes: dict[str, int]) -> None:
    """model.safetensors.index.json listing every key, when there is more than one shard."""
    if len(plan.shards) == 1:
        return
    weight_map = {o.key: s.shard for s in plan.steps for o in s.outputs}
    index = {"metadata": {"total_size": sum(shard_sizes.values())}, "weight_map": dict(sorted(weight_map.items()))}
    write_json(staging / SAFETENSORS_INDEX, index, sort_keys=False)


def side_files(source_dir: Path) -> list[Path]:
    """Files of the source to carry over (tokenizer, generation config, templates, code, licence), relative."""
    found = []
    for path in sorted(source_dir.rglob("*")):
        rel = path.relative_to(source_dir)
        if any(part.startswith(".") for part in rel.parts) or not path.is_file():
            continue  # .git, .cache (the Hub's download metadata), editor files
        if rel.suffix in WEIGHT_SUFFIXES or rel.name in INDEX_NAMES or rel.as_posix() in ("config.json", MANIFEST, CARD):
            continue
        found.append(rel)
    return found


def copy_side_files(source_dir: Path, staging: Path, files: list[Path]) -> None:
    for rel in files:
        try:
            (staging / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source_dir / rel, staging / rel)
        except OSError as e:
            # Opening the source's file failed (only then is filename2 unset: shutil's sendfile path names
            # both files on a failed write), or writing the copy did: say which, and what to do.
            if e.filename == str(source_dir / rel) and e.filename2 is None:
                raise PrequantError(
                    f"{source_dir / rel}: cannot read it ({e.strerror or e}); make it readable, or move it out of "
                    "the source directory"
                ) from e
            raise write_error(staging / rel, e) from e
