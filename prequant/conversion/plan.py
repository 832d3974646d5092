"""The plan: a pure function from tensor names, shapes, dtypes and decisions to what will be written.

Nothing here touches data. Every output key, dtype, shape and byte size follows from the source shapes,
so the writer knows each shard's layout before the first tensor is read; the one exception is the
quant-state JSON, whose length depends on the double-quant offset's decimal form (the writer reserves
room for it).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property

from ..bnb import experts
from ..bnb.format import QUANTIZABLE, Settings, loses_codes, settings_entries
from ..bnb.layout import Decision, Layout
from ..bnb.loading import should_convert
from ..checkpoint import quantized
from ..checkpoint.dtypes import itemsize
from ..checkpoint.hf_files import shard_name
from ..checkpoint.tensors import TensorRef
from ..errors import PrequantError, UsageError, skipping, spelled
from .writer import ShardLayout

QUANT_STATE_ESTIMATE = 170  # bytes of quant-state JSON, typical; the exact length is known only after quantizing


@dataclass(frozen=True)
class OutTensor:
    """One tensor of the output checkpoint. `shape` is None for the quant-state JSON (length known later)."""

    key: str
    dtype: str
    shape: tuple[int, ...] | None

    @property
    def nbytes(self) -> int:
        if self.shape is None:
            return QUANT_STATE_ESTIMATE
        return math.prod(self.shape) * itemsize(self.dtype)


@dataclass(frozen=True)
class Step:
    """One source tensor: what happens to it and where its outputs go."""

    source: TensorRef
    decision: Decision
    outputs: tuple[OutTensor, ...]
    shard: str
    shape: tuple[int, ...] | None = None  # the parameter's shape when the source stores it packed (a 4-bit base)

    @property
    def quantize(self) -> bool:
        return self.decision.quantize

    @property
    def action(self) -> str:
        """What happens to the tensor, in one word: quantize, keep, or the decision's own (merge, dequantize)."""
        return "quantize" if self.quantize else self.decision.action or "keep"

    @property
    def param_shape(self) -> tuple[int, ...]:
        """The parameter's shape (a packed 4-bit weight's as unpacked), as the report shows it."""
        return self.shape if self.shape is not None else tuple(self.source.shape)

    @property
    def numel(self) -> int:
        """The parameter's element count (a packed 4-bit weight's as unpacked, not its packed bytes)."""
        return math.prod(self.shape) if self.shape is not None else self.source.numel

    @property
    def out_bytes(self) -> int:
        return sum(o.nbytes for o in self.outputs)


@dataclass(frozen=True)
class Plan:
    """Everything convert will do, printable before doing it."""

    settings: Settings
    steps: tuple[Step, ...]
    shards: tuple[str, ...]
    skip_modules: list[str] | None
    method: str
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    # The layout is transformers' without its model having been built (`predict.settled`): said in the text, not
    # in to_dict(), whose hash a resume compares (how the same layout was arrived at does not change the job).
    settled: bool = False
    sixteen_bit: bool = False  # the output is 16-bit (a merge without --quantize): no 4-bit settings apply
    quantize_experts: bool = False  # --quantize-experts: every MoE expert weight 4-bit, under its own name
    # With MoE experts kept (transformers 5 fuses them): the output's size with --quantize-experts, when that
    # layout is handled (None otherwise).
    experts_output_bytes: int | None = None

    @property
    def input_bytes(self) -> int:
        """The source tensors' bytes in their 16-bit form (a quantized weight counts as the tensor it dequantizes to)."""
        return sum(s.source.nbytes for s in self.steps)

    @property
    def source_bytes(self) -> int:
        """The bytes read from the source: a quantized weight's codes, scales and riders, as they are on disk."""
        return sum(t.nbytes for t in quantized.stored(s.source for s in self.steps))

    @property
    def output_bytes(self) -> int:
        """The predicted size of all shards (see `shard_bytes`)."""
        return sum(self.shard_bytes().values())

    def shard_bytes(self) -> dict[str, int]:
        """Each shard's predicted file size: its header, exact (the writer's layout is fixed by the plan: 400 KB
        for 5,000 small tensors), plus its tensors, exact but for the quant-state JSON (estimated)."""
        return dict(self._shard_bytes)

    @cached_property
    def _shard_bytes(self) -> dict[str, int]:
        """`shard_bytes`, laid out once per plan: a layout is a pass over every output tensor (tens of thousands
        in a large MoE model), and the fingerprint, the text and the summary each ask."""
        outputs: dict[str, list[OutTensor]] = {name: [] for name in self.shards}
        for s in self.steps:
            outputs[s.shard] += s.outputs
        return {name: ShardLayout(outs).data_start + sum(o.nbytes for o in outs) for name, outs in outputs.items()}

    def unquantized(self) -> dict[str, int]:
        """Parameters left unquantized, counted by reason (4-bit data copied as stored is not)."""
        counts: dict[str, int] = {}
        for s in self.steps:
            if not s.quantize and s.action != "copy":
                reason = re.sub(r" into .*;", ";", s.decision.reason)  # group fused experts under one reason
                counts[reason] = counts.get(reason, 0) + s.numel
        return counts

    def all_notes(self) -> list[str]:
        """The experts sentence first when it applies (it says what most of the output is), then the layout's."""
        note = self.fused_experts_note()
        return [*([note] if note else []), *self.notes]

    def fused_experts_note(self) -> str | None:
        """What a MoE model's experts become: with --quantize-experts, how to load the output; without it, when
        the kept experts are most of the parameters, the figure, both output sizes and the flag to pass (None
        when neither applies)."""
        if self.quantize_experts:
            if not any(s.quantize and s.decision.fused for s in self.steps):
                return None
            return ("every MoE expert is 4-bit under its own name (as transformers 4.x + bitsandbytes wrote them): "
                    "transformers 4.57 loads this checkpoint as it is; on transformers 5, which fuses experts, load it "
                    "with prequant.load_model(path) (its own from_pretrained refuses it: size mismatch)")
        total = sum(s.source.numel for s in self.steps)
        fused = sum(s.source.numel for s in self.steps if s.decision.fused and not s.quantize)
        if not total or fused * 2 <= total:
            return None
        sizes = f"this output is {_human(self.output_bytes)} of {_human(self.input_bytes)}"
        if self.experts_output_bytes is not None:
            sizes += (f"; with {experts.FLAG} it would be {_human(self.experts_output_bytes)}, every expert 4-bit "
                      "(loaded by transformers 4.57, and by prequant.load_model on transformers 5)")
        return (f"{fused / total:.0%} of the parameters ({fused:,} of {total:,}) stay unquantized: transformers 5 "
                "fuses this model's MoE experts into 3-D parameters and bitsandbytes quantizes only nn.Linear "
                f"layers, so transformers keeps them in their original dtype too (bitsandbytes#1849); {sizes}")

    def tensor_counts(self) -> tuple[int, int, dict[str, int]]:
        """(quantized, kept as stored, the others by what became of them: {"merged": 4}), over every tensor."""
        others: dict[str, int] = {}
        for st in self.steps:
            if st.action not in ("quantize", "keep"):
                done = _DONE.get(st.action, st.action)
                others[done] = others.get(done, 0) + 1
        quantized = sum(st.quantize for st in self.steps)
        return quantized, len(self.steps) - quantized - sum(others.values()), others

    def to_dict(self) -> dict:
        quantized, kept, others = self.tensor_counts()
        return {
            "settings": None if self.sixteen_bit else vars(self.settings),
            "quantize_experts": self.quantize_experts,
            "method": self.method,
            "notes": self.all_notes(),
            **({"warnings": self.warnings} if self.warnings else {}),
            "llm_int8_skip_modules": self.skip_modules,
            "tensors": [
                {
                    "name": s.source.name,
                    "action": s.action,
                    "reason": s.decision.reason,
                    "dtype": s.source.dtype,
                    **({"cast_to": s.decision.dtype} if s.decision.dtype else {}),  # as transformers loads it
                    "shape": list(s.param_shape),
                    "input_bytes": s.source.nbytes,
                    "output_bytes": s.out_bytes,
                    "shard": s.shard,
                }
                for s in self.steps
            ],
            "shards": self.shard_bytes(),
            "quantized_tensors": quantized,
            "kept_tensors": kept,
            **({"other_tensors": others} if others else {}),
            "quantized_parameters": sum(s.numel for s in self.steps if s.quantize),
            "unquantized_parameters": self.unquantized(),
            "input_bytes": self.input_bytes,
            "output_bytes": self.output_bytes,
        }

    def to_text(self) -> str:
        s = self.settings
        written = ("16-bit, nothing quantized" if self.sixteen_bit else
                   f"{s.quant_type}, blocksize {s.blocksize}, double quant {'on' if s.double_quant else 'off'}, "
                   f"storage {s.quant_storage}, compute {s.compute_dtype}")
        lines = [
            f"plan: {written}"
            + (f", MoE experts 4-bit ({experts.FLAG})" if self.quantize_experts else "")
            + f"; decided by {self.method}"
            + (" (its rules, from names and config.json: verified for this transformers)" if self.settled else ""),
            *(f"note: {n}" for n in self.all_notes()),
            *(f"warning: {w}" for w in self.warnings),
        ]
        width = max((len(st.source.name) for st in self.steps), default=10)
        action_width = max((len(st.action) for st in self.steps), default=8)
        for st in self.steps:
            shape = "x".join(map(str, st.param_shape)) or "scalar"
            dtype = st.source.dtype + (f"->{st.decision.dtype}" if st.decision.dtype else "")
            lines.append(
                f"  {st.action:{max(action_width, 8)}} {st.source.name:{width}}  {dtype:>4} {shape:>14}  "
                f"{_human(st.source.nbytes):>9} -> {_human(st.out_bytes):>9}  {st.shard}  ({st.decision.reason})"
            )
        for name, size in self.shard_bytes().items():
            lines.append(f"shard {name}: {_human(size)}")
        for reason, n in self.unquantized().items():
            lines.append(f"unquantized: {n:,} parameters ({reason})")
        quantized, kept, others = self.tensor_counts()
        lines.append(
            f"total: {quantized} tensors quantized, {kept} kept, "
            + "".join(f"{n} {done}, " for done, n in others.items())
            + f"{_human(self.input_bytes)} -> {_human(self.output_bytes)} in {len(self.shards)} "
            + ("shard" if len(self.shards) == 1 else "shards")
        )
        return "\n".join(lines)


# An action, as the plan's total says it was done.
_DONE = {"merge": "merged", "dequantize": "dequantized", "copy": "copied 4-bit"}

# outputs(tensor, decision) -> its outputs, or None for those the decision implies (a merge's 4-bit base: `merging`)
Outputs = Callable[[TensorRef, Decision], "tuple[OutTensor, ...] | None"]


def make_plan(tensors: list[TensorRef], layout: Layout, settings: Settings, max_shard_size: int,
              skip: Sequence[str] = (), quantize_experts: bool = False, outputs: Outputs | None = None,
              shapes: Mapping[str, tuple[int, ...]] | None = None) -> Plan:
    """Decide every output tensor and its shard. Pure: same inputs, same plan. `skip`: the user's skip patterns,
    each warned about when it matches no module of the checkpoint (a typo keeps nothing). `quantize_experts`: MoE
    expert weights 4-bit too (`bnb.experts`; a layout it does not handle is refused). `outputs`: a tensor's outputs
    when they are not what its decision implies; `shapes`: the parameter shapes of tensors stored packed. A refusal
    names the options as its caller writes them (flags or keywords)."""
    if outputs is not None:
        return _make_plan(tensors, layout, settings, max_shard_size, skip, outputs, shapes or {})
    if quantize_experts:
        return replace(_make_plan(tensors, experts.quantize_experts(layout, tensors), settings, max_shard_size, skip), quantize_experts=True)
    plan = _make_plan(tensors, layout, settings, max_shard_size, skip)
    if plan.fused_experts_note() is None:
        return plan
    try:  # what the flag would give, said in the note
        alternative = _make_plan(tensors, experts.quantize_experts(layout, tensors), settings, max_shard_size, skip)
    except PrequantError:
        return plan
    return replace(plan, experts_output_bytes=alternative.output_bytes)


def _make_plan(tensors: list[TensorRef], layout: Layout, settings: Settings, max_shard_size: int,
               skip: Sequence[str], given: Outputs | None = None,
               shapes: Mapping[str, tuple[int, ...]] | None = None) -> Plan:
    if not tensors:
        raise PrequantError("the source holds no tensors; check that the weight files are not empty")
    groups: list[tuple[TensorRef, Decision, tuple[OutTensor, ...]]] = []
    for t in tensors:
        decision = layout.decisions[t.name]
        outputs = given(t, decision) if given is not None else None
        if outputs is None and decision.quantize:
            outputs = quantized_outputs(t, decision, settings)
        elif outputs is None:
            outputs = (OutTensor(t.name, decision.dtype or t.dtype, t.shape),)  # as transformers loads it
        groups.append((t, decision, outputs))
    shard_of = _assign_shards([sum(o.nbytes for o in outs) for _, _, outs in groups], max_shard_size)
    count = max(shard_of) + 1
    names = tuple(shard_name(i, count) for i in range(count))
    shapes = shapes or {}
    steps = tuple(Step(t, d, outs, names[shard_of[i]], shapes.get(t.name)) for i, (t, d, outs) in enumerate(groups))
    warnings = [*layout.warnings, *unmatched_skips(skip, tensors)]
    return Plan(settings, steps, names, layout.skip_modules, layout.method, list(layout.notes), warnings)


def unmatched_skips(skip: Sequence[str], tensors: list[TensorRef]) -> list[str]:
    """A warning for each skip pattern that matches no module of the checkpoint (as transformers matches
    llm_int8_skip_modules: from a module name's start to a boundary, or as its end)."""
    modules = {t.name.rpartition(".")[0] for t in tensors}
    return [f"the skip pattern {pattern!r} matches no module of the checkpoint, so it keeps nothing unquantized; "
            "check its spelling against the tensor names (a dry run lists them)"
            for pattern in dict.fromkeys(skip) if all(should_convert(m, [pattern]) for m in modules)]


def _check_quantizable(t: TensorRef, decision: Decision, settings: Settings) -> None:
    """Refuse, before any work, a weight bitsandbytes cannot quantize, or whose packed storage would lose bytes."""
    if (decision.dtype or t.dtype) not in QUANTIZABLE:
        raise PrequantError(
            f"tensor {t.name!r} has dtype {t.dtype}; only F32, F16 and BF16 weights can be quantized to 4 bit "
            f"(convert the checkpoint first, or keep that module with {skipping(t.name.removesuffix('.weight'))})"
        )
    if loses_codes(t.numel, settings.storage_code):
        raise PrequantError(
            f"tensor {t.name!r} has {t.numel:,} elements ({'x'.join(map(str, t.shape))}), and bitsandbytes' "
            f"{settings.quant_storage} storage for that many 4-bit codes is a byte short: the tensor could not be "
            f"dequantized; use {spelled('quant_storage', 'uint8')} (or {skipping(t.name.removesuffix('.weight'))})"
        )


def quantized_outputs(t: TensorRef, decision: Decision, s: Settings) -> tuple[OutTensor, ...]:
    """The keys transformers writes for a 4-bit weight, with their dtypes and shapes (`bnb.format`'s layout); a
    weight that has none is refused here, before any work (`_check_quantizable`)."""
    _check_quantizable(t, decision, s)
    return tuple(OutTensor(e.key, e.dtype, e.shape) for e in settings_entries(t.name, t.numel, s))


def _assign_shards(sizes: list[int], max_shard_size: int) -> list[int]:
    """Each group's shard, in processing order. One shard when everything fits; otherwise shards that shrink
    towards the end (`_tapered`), so that each one's sha256 is done by the time the last byte is written."""
    if sum(sizes) <= max_shard_size:
        return [0] * len(sizes)
    return _tapered(sizes, max_shard_size)


# Why the last shards are small: a shard is hashed (sha256, for prequant.json) once its last tensor is
# written, and the header, which comes first, holds every quant-state JSON's length, so the hash cannot
# start earlier. With shards filled front to back (transformers' way) the last full shard completes
# shortly before the end and its hash, seconds long, runs after everything else. So each shard holds at most
# as much as all the shards after it together: its hash (at about the disk's speed) is done by the time they are
# written, even when they are written at the disk's speed, as a large kept tensor is copied.
TAIL_SHARD = 512 * 10**6  # the last shard's bytes, at most (one group larger than that gets a shard alone)


def _tapered(sizes: list[int], max_shard_size: int) -> list[int]:
    """Shards filled from the end backwards: the last up to TAIL_SHARD, each earlier one up to the bytes of all the
    shards after it (at least TAIL_SHARD, at most max_shard_size); a group larger than its limit gets a shard alone."""
    bounds: list[int] = []  # index of each shard's first group, last shard first
    end, after = len(sizes), 0
    while end > 0:
        limit = min(max_shard_size, max(TAIL_SHARD, after))
        start, used = end - 1, sizes[end - 1]
        while start > 0 and used + sizes[start - 1] <= limit:
            start -= 1
            used += sizes[start]
        bounds.append(start)
        end, after = start, after + used
    starts = bounds[::-1]
    ends = [*starts[1:], len(sizes)]
    return [shard for shard, (start, stop) in enumerate(zip(starts, ends)) for _ in range(start, stop)]


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


def parse_size(text: str | int, said: str | None = None) -> int:
    """'5GB' -> 5_000_000_000, '500MiB' -> 524_288_000, as transformers reads max_shard_size. A UsageError names
    the value as `said` (how the caller wrote the option, e.g. `--max-shard-size lots`), else as its repr."""
    said = said or repr(text)
    if isinstance(text, int) and not isinstance(text, bool):
        size = text
    else:
        m = _SIZE.match(text) if isinstance(text, str) else None
        if not m:
            raise UsageError(f"{said} is not a size; write e.g. 5GB, 500MB or 2GiB")
        unit = (m.group(2) or "").lower()
        if "i" in unit:
            factor = 1024 ** ("kmgt".index(unit[0]) + 1)
        else:
            factor = _UNITS[unit if unit.endswith("b") or unit == "" else unit + "b"]
        size = int(float(m.group(1)) * factor)
    if size <= 0:
        raise UsageError(f"{said} must be positive")
    return size


def _human(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n} B"
