"""What transformers does with each checkpoint tensor when it loads it: the dtype it casts it to, the shape it
requires, and how it matches `llm_int8_skip_modules` (today's rules, and transformers 4.x's, which a checkpoint
should satisfy too: people load with both). `layout` applies them; the rules are here, once.

transformers 5 (`from_pretrained`, default `dtype="auto"`) loads the model in config.json's `dtype` (or the older
`torch_dtype`), else in the dtype of the first floating-point tensor of the first weight file, float8 aside. A
weight it quantizes is cast to that dtype first; a weight it keeps, to the dtype of the model's parameter (the
same, unless the model makes that parameter in another dtype); `_keep_in_fp32_modules` (for float16) and
`_keep_in_fp32_modules_strict` (for float16 and bfloat16) stay float32. A checkpoint tensor whose shape is not
the model parameter's is an error ("size mismatch"), never silently reshaped. So is a set of per-expert tensors that
does not make up the 3-D parameter transformers 5 stacks them into (native MoE experts): one of another shape, a
number outside the model's experts, an expert missing (`check_fused`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from ..checkpoint.tensors import TensorRef, quote
from ..errors import PrequantError, flag

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


_MISMATCH = ("the weights do not match config.json (a wrong config, or a corrupt, incomplete or edited file): fix or "
             "re-download the checkpoint")


def check_shape(t: TensorRef, expected: tuple[int, ...], model_name: str) -> None:
    """transformers refuses a checkpoint tensor shaped otherwise than the model's parameter; so does prequant."""
    if tuple(t.shape) != tuple(expected):
        raise PrequantError(
            f"tensor {quote(t.name)} has shape {list(t.shape)}, but {model_name} built from config.json expects "
            f"{list(expected)}{_transposed(t.shape, expected)}; {_MISMATCH}",
            where=t.file.name,
        )


@dataclass(frozen=True)
class Stacking:
    """How transformers 5 fuses the checkpoint tensors of one pattern into a 3-D parameter (its converter for native
    MoE experts): the experts stacked along dimension 0, each expert's `parts` concatenated along `dim` first, as
    gate then up rows make `gate_up_proj [E, 2I, H]`. One per pattern, shared by every tensor it matches."""

    part: int  # which of the concatenated parts (the converter's source patterns) this pattern is
    dim: int | None  # the per-expert dimension the parts are concatenated along (None: one part)
    patterns: tuple[str, ...]  # the converter's source pattern of each part, e.g. ".experts.*.w1.weight"

    @property
    def parts(self) -> int:
        return len(self.patterns)

    @cached_property
    def _number(self) -> re.Pattern[str]:
        return re.compile(r"(\d+)" + re.escape(self.patterns[self.part].rpartition("*")[2]) + "$")

    def index(self, name: str) -> int | None:
        """The expert's number in a checkpoint key of this pattern (what its `*` matches); None if it holds none."""
        found = self._number.search(name)
        return int(found[1]) if found else None


def check_fused(param: str, shape: Sequence[int], members: Sequence[tuple[TensorRef, Stacking]],
                model_name: str) -> None:
    """Refuse, as transformers' loader does, per-expert tensors that do not make up the fused parameter `param` of
    `shape` (`[E, ...]`, from the model built from config.json): a tensor shaped otherwise than one expert's part, a
    number that is not one of the E experts or is given twice, an expert missing. One pass over names and shapes."""
    if not shape or not members:
        return
    experts = shape[0]
    layout = f"{model_name} built from config.json has {experts} experts in {param} {list(shape)}"
    first, stacking = members[0]  # one converter's: every part shares its dim and patterns
    expected = _part_shape(shape, stacking)
    by_part: dict[int, dict[int, TensorRef]] = {}  # part -> expert number -> its tensor
    for t, f in members:
        if expected is not None and tuple(t.shape) != expected:
            raise PrequantError(
                f"tensor {quote(t.name)} has shape {list(t.shape)}, but {model_name} built from config.json expects "
                f"{list(expected)} for each expert's part of {param} {list(shape)}{_transposed(t.shape, expected)}; "
                f"{_MISMATCH}", where=t.file.name)
        index = f.index(t.name)
        if index is None:
            continue
        if index >= experts:
            raise PrequantError(
                f"tensor {quote(t.name)} is expert {index}, but {layout}, numbered 0 to {experts - 1}; {_MISMATCH}",
                where=t.file.name)
        held = by_part.setdefault(f.part, {})
        if index in held:
            raise PrequantError(
                f"tensor {quote(t.name)} is expert {index} of {param}, which {quote(held[index].name)} "
                f"already is; {_MISMATCH}", where=t.file.name)
        held[index] = t
    if not by_part:
        return
    for part in range(stacking.parts):
        held = by_part.get(part, {})
        missing = next((i for i in range(experts) if i not in held), None)
        if missing is None:
            continue
        if not held:  # the checkpoint holds none of this part: named by the converter's pattern
            pattern = stacking.patterns[part]
            raise PrequantError(
                f"the checkpoint holds no tensor matching {pattern!r} for {param}, but {model_name} built from "
                f"config.json takes one for each of its {experts} experts; {_MISMATCH}", where=first.file.name)
        index, t = next(iter(held.items()))
        raise PrequantError(
            f"tensor {quote(_renumbered(t.name, index, missing))} is missing: {layout}, and the checkpoint holds "
            f"{len(held)} of them ({quote(t.name)} is one); {_MISMATCH}", where=t.file.name)


def _part_shape(shape: Sequence[int], f: Stacking) -> tuple[int, ...] | None:
    """One expert's part of a fused parameter of `shape`; None when the parameter cannot be split so."""
    each = list(shape[1:])
    if f.dim is not None:
        if not 0 <= f.dim < len(each) or each[f.dim] % f.parts:
            return None
        each[f.dim] //= f.parts
    return tuple(each)


def _renumbered(name: str, index: int, other: int) -> str:
    """`name` with its expert number (the last `.<index>.` component) `other`."""
    head, found, tail = name.rpartition(f".{index}.")
    return f"{head}.{other}.{tail}" if found else name


def _transposed(shape: Sequence[int], expected: Sequence[int]) -> str:
    """Said when a 2-D tensor holds the expected shape transposed (same element count: only the shape tells)."""
    same = len(shape) == 2 and list(shape) == list(reversed(expected)) and shape[0] != shape[1]
    return " (it is stored transposed)" if same else ""


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
            f"{flag('skip', None)} {pattern!r}: transformers 4.x matches llm_int8_skip_modules only by module name or module path "
            f"prefix, so it would load {modules[0]}{more} as 4-bit and fail; to load with transformers 4.x as well, "
            f"pass the module name ({modules[0].rpartition('.')[2]}) or full path instead"
        )
    return warnings
