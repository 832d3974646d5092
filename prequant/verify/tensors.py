"""verify's checks of the tensors themselves: every quant state (keys, values) and its companions (present,
same shard, dtypes and shapes implied by the state's shape and blocksize, no stray keys under it), and
config.json's quantization_config against the tensors present."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from ..bnb.format import (
    COMPANIONS,
    COMPUTE_NAMES,
    STORAGE_CODES,
    decode_quant_state,
    entries,
    is_nested,
    packed_length,
    quant_state_problems,
    split_state_key,
    state_key,
)
from ..bnb.loading import should_convert
from ..checkpoint.hf_files import CONFIG
from ..checkpoint.reader import TensorReader
from ..checkpoint.tensors import TensorRef
from .report import Report


@dataclass
class Group:
    """A quantized tensor: its packed weight key, parsed quant state and the keys expected with it."""

    weight: str
    state: dict
    quant_type: str
    nested: bool
    storage: str | None = None  # safetensors dtype code of the packed weight
    complete: bool = True


# -------------------------------------------------------------------------------------- quantized


def check_quantized(refs: dict[str, TensorRef], shard_of: dict[str, str], report: Report) -> dict[str, Group]:
    """Every quant state parses and has exactly its companions, with the dtypes and shapes it implies."""
    groups: dict[str, Group] = {}
    with TensorReader() as data:
        for key in sorted(k for k in refs if split_state_key(k) is not None):
            weight, quant_type = split_state_key(key)  # type: ignore[misc]
            group = _parse_state(key, refs[key], data, quant_type, report)
            if group is None:
                continue
            groups[weight] = group
            _check_companions(group, refs, shard_of, report)
    claimed = {k for g in groups.values() for k in expected_keys(g)}
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


def _parse_state(key: str, ref: TensorRef, data: TensorReader, quant_type: str, report: Report) -> Group | None:
    weight = split_state_key(key)[0]  # type: ignore[index]
    if ref.dtype != "U8" or len(ref.shape) != 1:
        report.fail(key, f"is {ref.dtype}{list(ref.shape)}; a quant state is 1-D U8 (JSON bytes)")
        return None
    try:
        state = decode_quant_state(data.view(ref).numpy().tobytes())
    except (ValueError, UnicodeDecodeError) as e:
        report.fail(key, f"quant state is not valid JSON ({e}); the output is damaged, reconvert")
        return None
    if not isinstance(state, dict):
        report.fail(key, "quant state is not a JSON object; the output is damaged, reconvert")
        return None
    problems = quant_state_problems(state, quant_type)
    if problems:
        report.fail(key, "quant state " + "; ".join(problems) + "; the output is damaged, reconvert")
        return None
    return Group(weight, state, quant_type, is_nested(state))


def expected_keys(g: Group) -> dict[str, tuple[tuple[str, ...], tuple[int, ...] | None]]:
    """Companion key -> (allowed dtypes, shape), as `bnb.format` lays them out; the packed weight may be stored as
    any storage dtype, and its shape depends on which (None here)."""
    layout = entries(g.weight, math.prod(g.state["shape"]), quant_type=g.quant_type, blocksize=g.state["blocksize"],
                     double_quant=g.nested, storage_code="U8")
    keys = {e.key: ((e.dtype,), e.shape) for e in layout}
    keys[g.weight] = (tuple(STORAGE_CODES.values()), None)
    return keys


def _check_companions(g: Group, refs: dict[str, TensorRef], shard_of: dict[str, str], report: Report) -> None:
    n = math.prod(g.state["shape"])
    home = shard_of.get(state_key(g.weight, g.quant_type))
    expected = expected_keys(g)
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
            shape = (packed_length(n, ref.dtype), 1)
        if shape is not None and ref.shape != shape:
            report.fail(key, f"shape {list(ref.shape)}, but the quant state (shape {g.state['shape']}, blocksize "
                        f"{g.state['blocksize']}) implies {list(shape)}")
            g.complete = False
    prefix = g.weight + "."
    for key in refs:
        if key.startswith(prefix) and key not in expected:
            report.fail(key, f"unexpected key under the 4-bit tensor {g.weight}; transformers refuses unknown quant keys")


# ----------------------------------------------------------------------------------------- config


def check_config(out: Path, groups: dict[str, Group], report: Report) -> None:
    """config.json's quantization_config against the 4-bit tensors found (type, double quant, storage, skip list)."""
    before = len(report.problems)
    where = CONFIG
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
            report.fail(where, f"quantization_config.{k} is {_value(qc, k)}, expected {v!r}")
    if not groups:
        report.fail(where, "quantization_config says 4-bit, but no tensor has a 4-bit quant state")
    types = {g.quant_type for g in groups.values()}
    if len(types) > 1:
        report.fail(where, f"tensors mix quant types {sorted(types)}; one checkpoint has one bnb_4bit_quant_type")
    elif types and qc.get("bnb_4bit_quant_type") != next(iter(types)):
        report.fail(where, f"bnb_4bit_quant_type is {_value(qc, 'bnb_4bit_quant_type')} but the tensors are "
                    f"{next(iter(types))}")
    nested = {g.nested for g in groups.values()}
    if len(nested) == 1 and qc.get("bnb_4bit_use_double_quant") != next(iter(nested)):
        report.fail(where, f"bnb_4bit_use_double_quant is {_value(qc, 'bnb_4bit_use_double_quant')} but the tensors "
                    f"are {'double-quantized' if next(iter(nested)) else 'not double-quantized'}")
    storages = {g.storage for g in groups.values() if g.storage}
    want = STORAGE_CODES.get(str(qc.get("bnb_4bit_quant_storage", "uint8")))
    if want is None:
        report.fail(where, f"bnb_4bit_quant_storage {qc.get('bnb_4bit_quant_storage')!r} is not one of {', '.join(STORAGE_CODES)}")
    elif storages and storages != {want}:
        said = repr(qc.get("bnb_4bit_quant_storage", "uint8"))
        report.fail(where, f"bnb_4bit_quant_storage is {said} ({want}) but the packed weights are "
                    f"{', '.join(sorted(storages))}")
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


def _value(qc: dict, key: str) -> str:
    """A quantization_config entry as a report says it: its value, or that it is missing."""
    return repr(qc[key]) if key in qc else "missing"
