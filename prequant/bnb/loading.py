"""What transformers does with each checkpoint tensor when it loads it: the dtype it casts it to, the shape it
requires, and how it matches `llm_int8_skip_modules` (today's rules, and transformers 4.x's, which a checkpoint
should satisfy too: people load with both). `layout` applies them; the rules are here, once.

transformers 5 (`from_pretrained`, default `dtype="auto"`) loads the model in config.json's `dtype` (or the older
`torch_dtype`), else in the dtype of the first floating-point tensor of the first weight file, float8 aside. A
weight it quantizes is cast to that dtype first; a weight it keeps, to the dtype of the model's parameter (the
same, unless the model makes that parameter in another dtype); `_keep_in_fp32_modules` (for float16) and
`_keep_in_fp32_modules_strict` (for float16 and bfloat16) stay float32. A checkpoint tensor whose shape is not
the model parameter's is an error ("size mismatch"), never silently reshaped.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

from ..checkpoint.tensors import TensorRef, quote
from ..errors import PrequantError

# Floating-point dtypes cast among as transformers casts them (safetensors codes). float8 is left as it is: its
# values mean nothing without their scales, so casting one would only hide that the checkpoint is not bf16.
CASTABLE = ("F16", "BF16", "F32", "F64")
_CODES = {"float16": "F16", "half": "F16", "bfloat16": "BF16", "float32": "F32", "float": "F32", "float64": "F64",
          "double": "F64"}
_BOUNDARY = r"(?:(?<=\.)|(?=\.|$))"


def load_dtype(config: dict, tensors: Iterable[TensorRef]) -> str | None:
    """The safetensors code of the dtype transformers loads this model in (None: no floating-point tensor)."""
    named = config.get("dtype") or config.get("torch_dtype")
    if isinstance(named, str) and named.removeprefix("torch.") in _CODES:
        return _CODES[named.removeprefix("torch.")]
    refs = list(tensors)
    if not refs:
        return None
    # transformers reads the first file of the sorted shard list, a safetensors file's keys sorted by name.
    first: Path = min({t.file for t in refs}, key=lambda p: p.name)
    in_file = [t for t in refs if t.file == first]
    if first.suffix == ".safetensors":
        in_file.sort(key=lambda t: t.name)
    return next((t.dtype for t in in_file if t.dtype in CASTABLE), None)


def cast_code(source: str, target: str | None) -> str | None:
    """`target` when a tensor stored as `source` is cast to it on load; None when it stays as it is."""
    if target is None or source == target or source not in CASTABLE or target not in CASTABLE:
        return None
    return target


def fp32_pattern(model: object, dtype_code: str | None) -> re.Pattern[str] | None:
    """The parameters transformers keeps in float32 for this load dtype (its `_get_dtype_plan`, matched as its
    loader matches it: globs, searched in the parameter name), or None."""
    import torch

    names = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64}
    get_plan = getattr(model, "_get_dtype_plan", None)
    if get_plan is None or dtype_code is None:
        return None
    plan = get_plan(names[dtype_code])
    return re.compile("|".join(f"(?:{p.replace('*', '.*')})" for p in plan)) if plan else None


def check_shape(t: TensorRef, expected: tuple[int, ...], model_name: str) -> None:
    """transformers refuses a checkpoint tensor shaped otherwise than the model's parameter; so does prequant."""
    if tuple(t.shape) != tuple(expected):
        raise PrequantError(
            f"tensor {quote(t.name)} has shape {list(t.shape)}, but {model_name} built from config.json expects "
            f"{list(expected)}; the weights do not match config.json (a wrong config, or a corrupt or edited file): "
            "fix or re-download the checkpoint",
            where=t.file.name,
        )


# ------------------------------------------------------------------------------------ llm_int8_skip_modules


def should_convert(module: str, patterns: Iterable[str]) -> bool:
    """transformers' skip-list matching: a pattern matches a module name from its start up to a module
    boundary (also as a regex), or as a suffix."""
    for pattern in patterns:
        try:
            if re.match(rf"(?:{pattern}){_BOUNDARY}", module):
                return False
        except re.error:
            pass  # not a regex (refused by `skip_problem` for --skip): plain matching below still applies
        if module.endswith(pattern):
            return False
    return True


def skip_problem(pattern: str) -> str | None:
    """Why transformers cannot use `pattern` in llm_int8_skip_modules (it compiles each as a regex), or None."""
    if not pattern.strip():
        return "is empty (it would match every module)"
    try:
        re.compile(rf"(?:{pattern}){_BOUNDARY}")
    except re.error as e:
        return (f"is not a valid regular expression ({e}), and transformers matches llm_int8_skip_modules as "
                "regular expressions; escape its special characters")
    return None


def matched_by_4x(module: str, patterns: Iterable[str]) -> bool:
    """transformers 4.x's matching: a pattern is the module's own name, its full name, or a module path prefix
    ("model.layers.0" keeps "model.layers.0.mlp.up_proj"); no regex, no dotted suffix."""
    return any(p == module.rpartition(".")[2] or p == module or p + "." in module for p in patterns)


def unmatched_by_4x(skipped: dict[str, str], written: list[str]) -> list[str]:
    """Warnings for the --skip patterns (`skipped`: module -> the pattern keeping it) whose modules transformers
    4.x would quantize anyway with the `written` llm_int8_skip_modules: loading with 4.x would then fail."""
    found: dict[str, list[str]] = {}
    for module, pattern in skipped.items():
        if not matched_by_4x(module, written):
            found.setdefault(pattern, []).append(module)
    warnings = []
    for pattern, modules in found.items():
        more = f" and {len(modules) - 1} more" if len(modules) > 1 else ""
        warnings.append(
            f"--skip {pattern!r}: transformers 4.x matches llm_int8_skip_modules only by module name or module path "
            f"prefix, so it would load {modules[0]}{more} as 4-bit and fail; to load with transformers 4.x as well, "
            f"pass the module name ({modules[0].rpartition('.')[2]}) or full path instead"
        )
    return warnings
