"""verify --source: each quantized tensor dequantized and compared with the original (relative L2 error and max
error, with limits), each kept tensor byte for byte. Which tensors were quantized transposed (GPT-2 Conv1D) is read
from prequant.json, or, for a manifest without that record, decided from the source's architecture as convert
decides it (never guessed from shapes: square weights are ambiguous). The source itself is checked as convert checks
it: a source convert refuses (a tensor of another shape than config.json's model, a MoE expert missing, extra or
shaped otherwise) fails verify."""

from __future__ import annotations

import torch

from ..bnb import stats
from ..bnb.loading import cast_code
from ..bnb.predict import decide
from ..checkpoint import quantized
from ..checkpoint.dtypes import NAMED, TORCH_TO_SAFETENSORS, torch_name
from ..checkpoint.hf_files import read_config
from ..checkpoint.manifest import MANIFEST
from ..checkpoint.reader import TensorReader, scan_files
from ..checkpoint.tensors import TensorRef
from ..errors import PrequantError, skipping
from ..source.resolve import resolve
from ..source.spec import Source
from ..util.progress import Progress
from .check import Group, Report, expected_keys

FAIL_FACTOR = 4.0  # heavy-tailed weights reach ~3x the Gaussian figure; a wrong tensor is >= 1.0
OUTLIER_FACTOR = 1.5  # above this multiple of the Gaussian figure a tensor is flagged (warning)
MAX_ERROR_RATIO = 1.0  # an element off by more than the largest block scale is not rounding


def compare_source(
    spec: str,
    refs: dict[str, TensorRef],
    groups: dict[str, Group],
    report: Report,
    max_rel_error: float | None,
    progress: bool,
    transposed: list[str] | None,
) -> None:
    """Compare the output's tensors (`refs`, `groups`) with the source `spec`'s, filing what differs in `report`.
    `transposed`: prequant.json's record of the tensors quantized transposed (None when it has none)."""
    src = resolve(spec)
    src_refs, config = _as_16bit(src, scan_files(src.weight_files))
    found = _source_transposed(src, src_refs, config, report, recorded=transposed is not None)
    if transposed is None:
        transposed = found
        if transposed is None:
            return
    transposed_set = set(transposed)
    per_tensor: dict[str, stats.TensorStats] = {}
    limits: set[float] = set()
    kept = 0
    accounted: set[str] = set()
    with TensorReader() as sdata, TensorReader() as odata, Progress(
        sum(t.nbytes for t in src_refs), enabled=progress, label="comparing"
    ) as bar:
        for t in src_refs:
            bar.advance(t.nbytes)
            group = groups.get(t.name)
            if group is not None:
                accounted.update(expected_keys(group))
                if not group.complete:
                    continue  # already reported; its bytes cannot be interpreted
                st = _compare_quantized(t, group, t.name in transposed_set, sdata, odata, refs, report)
                if st is None:
                    continue
                per_tensor[t.name] = st
                expected = stats.expected_rel_error(group.quant_type, group.state["blocksize"])
                limit = max_rel_error if max_rel_error is not None else round(FAIL_FACTOR * expected, 3)
                limits.add(limit)
                _judge(t.name, st, expected, limit, report)
            elif t.name in refs:
                accounted.add(t.name)
                kept += 1
                out = refs[t.name]
                if out.shape != t.shape or (out.dtype != t.dtype and cast_code(t.dtype, out.dtype) is None):
                    report.fail(t.name, f"is {out.dtype}{list(out.shape)} but the source has {t.dtype}{list(t.shape)}")
                elif not _same_bytes(odata.view(out), sdata.view(t)):
                    cast = f" (cast to {out.dtype}, as transformers loads it)" if out.dtype != t.dtype else ""
                    report.fail(t.name, f"kept unquantized, but its bytes differ from the source{cast}")
            else:
                report.fail(t.name, "in the source but not in the output")
    src_names = {t.name for t in src_refs}
    for key in sorted(set(refs) - accounted - src_names):
        report.fail(key, "in the output but not in the source (was it converted from another checkpoint?)")
    report.source = {
        "spec": spec,
        "quantized": len(per_tensor),
        "kept": kept,
        "limit": max(limits) if limits else max_rel_error,
        "summary": stats.summarize(per_tensor),
        "tensors": {name: st.to_dict() | {"error_ratio": round(st.error_ratio, 6)} for name, st in per_tensor.items()},
    }


def _source_transposed(src: Source, src_refs: list[TensorRef], config: dict | None, report: Report, *,
                       recorded: bool) -> list[str] | None:
    """The tensors convert quantizes transposed, from the source's layout decided as convert decides it (remote code
    never run; no skip list, which never changes how a tensor is laid out), which checks every tensor against the
    model config.json builds as convert does (shapes; MoE experts missing, extra or shaped otherwise); None, with
    the problem reported, if the source is refused. `config`: the source's as convert reads it (`_as_16bit`), None
    where it is unreadable. `recorded`: prequant.json records the transposed tensors (then a refused source is
    reported as such and the comparison goes on; else nothing can be compared)."""
    try:
        layout, _ = decide(config if config is not None else read_config(src.path), src.path, src_refs, [])
    except PrequantError as e:
        if recorded:
            report.fail(f"source {e.where}" if e.where else "source", f"{e.detail} (convert refuses this source)")
        else:
            report.fail(MANIFEST, f"does not record which tensors were quantized transposed, and the source's "
                        f"architecture cannot tell ({e.message}); the source cannot be compared")
        return None
    return [name for name, decision in layout.decisions.items() if decision.transpose]


def _compare_quantized(
    t: TensorRef,
    g: Group,
    transpose: bool,
    sdata: TensorReader,
    odata: TensorReader,
    refs: dict[str, TensorRef],
    report: Report,
) -> stats.TensorStats | None:
    shape = tuple(g.state["shape"])
    x = sdata.view(t)
    if transpose:  # GPT-2 Conv1D weights are stored [in, out] and quantized transposed
        if x.dim() != 2:
            report.fail(t.name, f"recorded as quantized transposed, but the source's is {x.dim()}-D {list(t.shape)}")
            return None
        x = x.t()
    if tuple(x.shape) != shape:
        layout = " (transposed, as it was quantized)" if transpose else ""
        report.fail(t.name, f"quant state shape {list(shape)} does not match the source's {list(x.shape)}{layout}")
        return None
    if torch_name(x.dtype) != g.state["dtype"]:
        # A tensor transformers loads in the model's dtype is cast before quantizing, as convert does.
        wanted = TORCH_TO_SAFETENSORS[NAMED[g.state["dtype"]]]
        if cast_code(t.dtype, wanted) is None:
            report.fail(t.name, f"quant state dtype {g.state['dtype']} but the source is {torch_name(x.dtype)}")
            return None
        x = x.to(NAMED[g.state["dtype"]])
    w = g.weight
    parts = ("weight", "absmax", "quant_map", *(("nested_absmax", "nested_quant_map") if g.nested else ()))
    entries = {p: odata.view(refs[w if p == "weight" else f"{w}.{p}"]) for p in parts}
    return stats.entry_stats(x, entries, g.state)


def _judge(name: str, st: stats.TensorStats, expected: float, limit: float, report: Report) -> None:
    if not st.finite:
        report.fail(name, "dequantizes to NaN or Inf; the 4-bit data or its scales are damaged, reconvert")
    elif limit < st.rel_error <= OUTLIER_FACTOR * expected and st.error_ratio <= MAX_ERROR_RATIO:
        # 4-bit rounding as these settings give it, every element within its block's scale: the limit is too tight
        report.fail(name, f"relative error {st.rel_error:.4f} exceeds the limit {limit}, but is the rounding error "
                    f"these 4-bit settings give (about {expected} expected): the data matches the source; set a limit "
                    "above the format's error, or convert with a smaller block size for less of it")
    elif st.rel_error > limit:
        report.fail(name, f"relative error {st.rel_error:.4f} exceeds the limit {limit} (expected about "
                    f"{expected}); the 4-bit data does not match the source")
    elif st.error_ratio > MAX_ERROR_RATIO:
        report.fail(name, f"an element is off by {st.max_abs_error:.4g}, more than the largest block scale "
                    f"{st.absmax_max:.4g}: not 4-bit rounding, the data is damaged")
    elif st.rel_error > OUTLIER_FACTOR * expected:
        report.warn(name, f"relative error {st.rel_error:.4f} is an outlier (about {expected} expected for "
                    f"Gaussian-like weights): heavy-tailed weights; consider {skipping(name.removesuffix('.weight'))}")


def _same_bytes(out: torch.Tensor, source: torch.Tensor, chunk: int = 1 << 24) -> bool:
    """Whether a kept tensor holds the source's bytes, cast to its dtype first where convert casts (in chunks:
    memory stays bounded whatever the tensor's size)."""
    a, b = out.reshape(-1), source.reshape(-1)
    return a.numel() == b.numel() and all(
        torch.equal(a[i : i + chunk].view(torch.uint8), b[i : i + chunk].to(a.dtype).view(torch.uint8))
        for i in range(0, a.numel(), chunk)
    )


def _as_16bit(src: Source, refs: list[TensorRef]) -> tuple[list[TensorRef], dict | None]:
    """The source as convert reads it (`quantized.as_16bit`): a quantized source's weights as the 16-bit tensors they
    stand for (their scales folded into them) and its config.json without the quantization_config; any other
    source's as they are. A source without a readable config.json: its tensors and None (reported where the layout
    is needed)."""
    try:
        config = read_config(src.path)
    except PrequantError:
        return refs, None
    return quantized.as_16bit(refs, config)
