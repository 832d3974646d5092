"""Per-tensor quality statistics: dequantize a 4-bit tensor and measure its error against the source.

On a GPU the values come from bitsandbytes' own dequantization kernels, on the quantizer's own tensors; on the CPU
from prequant's kernels' thread pool (`kernels._compare`). Work goes in block-aligned chunks, so memory stays bounded
whatever the tensor size, and a transposed (Conv1D) source is read a few rows at a time instead of being copied
whole.

Dequantization follows bitsandbytes: value = quant_map[code] * absmax[block], codes packed two per byte
(element 2j in the high nibble); with double quantization
absmax = nested_quant_map[absmax_code] * nested_absmax[block // 256] + nested_offset.
Arithmetic is float32 (bitsandbytes' kernel computes in float32 before casting to the state dtype).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import numpy as np
import torch

from . import cuda
from .format import NESTED_BLOCKSIZE, STATE_PREFIX, decode_quant_state
from .kernels import _compare

CHUNK_ELEMENTS = 1 << 20  # per pass; small enough to stay in cache on the CPU, a few MB on a GPU
GPU_CHUNK_ELEMENTS = 1 << 24  # ~200 MB of temporaries: small next to the tensors in flight
# Relative L2 error of bitsandbytes 4-bit on Gaussian weights, by quant type and block size (measured).
EXPECTED_REL_ERROR = {
    "nf4": {64: 0.092, 128: 0.096, 256: 0.099, 512: 0.102, 1024: 0.104, 2048: 0.107, 4096: 0.110},
    "fp4": {64: 0.122, 128: 0.129, 256: 0.135, 512: 0.141, 1024: 0.147, 2048: 0.153, 4096: 0.159},
}


@dataclass(frozen=True)
class TensorStats:
    """Error of one dequantized tensor against its source, and the range of its block scales."""

    numel: int
    absmax_min: float  # smallest / largest dequantized per-block absmax
    absmax_max: float
    rel_error: float  # ||dequant - x||_2 / ||x||_2 (0 when both are zero)
    max_abs_error: float  # max |dequant - x|

    @property
    def error_ratio(self) -> float:
        """max_abs_error / absmax_max: 4-bit rounding keeps it under ~0.17 (half the widest code gap)."""
        if self.absmax_max == 0:
            return 0.0 if self.max_abs_error == 0 else math.inf
        return self.max_abs_error / self.absmax_max

    @property
    def finite(self) -> bool:
        return all(math.isfinite(v) for v in (self.absmax_min, self.absmax_max, self.rel_error, self.max_abs_error))

    def to_dict(self) -> dict:
        """JSON-ready: 6 significant digits, non-finite values as None (JSON has no NaN)."""
        return {k: (v if isinstance(v, int) else _round(v)) for k, v in asdict(self).items()}


def quant_state(entries: dict[str, torch.Tensor]) -> dict:
    """The parsed quant-state JSON among a tensor's entries (keys as in `quantize_tensor`)."""
    key = next(k for k in entries if k.startswith(STATE_PREFIX))
    return decode_quant_state(bytes(entries[key].cpu().tolist()))  # type: ignore[return-value]


def dequantize_absmax(
    absmax: torch.Tensor,
    nested_absmax: torch.Tensor | None = None,
    nested_quant_map: torch.Tensor | None = None,
    offset: float = 0.0,
    nested_blocksize: int = NESTED_BLOCKSIZE,
) -> torch.Tensor:
    """The float32 per-block absmax: as stored, or decoded from its 8-bit double-quantized codes (blocks of
    `nested_blocksize`, the quant state's)."""
    if nested_absmax is None:
        return absmax.float()
    if not absmax.is_cuda:
        return _compare.dequantize_nested(absmax, nested_absmax, nested_quant_map, offset, nested_blocksize)
    # bitsandbytes' kernel: code[q] * scale in float32, as its 4-bit dequantization decodes them, then the offset
    codes, nested_map = absmax.reshape(-1).view(torch.uint8), nested_quant_map.float()  # type: ignore[union-attr]
    return cuda.dequantize_blockwise(codes, nested_absmax.float(), nested_map, nested_blocksize).add_(offset)


def entry_stats(source: torch.Tensor, entries: dict[str, torch.Tensor], state: dict | None = None) -> TensorStats:
    """Statistics of one quantized tensor from its checkpoint entries (short names: weight, absmax, ...);
    `state`: its parsed quant state where the caller has it (default: parsed from the entries)."""
    state = state if state is not None else quant_state(entries)
    absmax = dequantize_absmax(entries["absmax"], entries.get("nested_absmax"), entries.get("nested_quant_map"),
                               state.get("nested_offset", 0.0), state.get("nested_blocksize", NESTED_BLOCKSIZE))
    return compare(source, entries["weight"], absmax, entries["quant_map"], state["blocksize"], state.get("quant_type"))


def compare(
    source: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor, quant_map: torch.Tensor, blocksize: int,
    quant_type: str | None = None,
) -> TensorStats:
    """Dequantize `packed` chunk by chunk and compare it with `source` (flattened row-major).

    Weights far from 1 are scaled by a power of two near the largest block scale first (exact: only exponents
    change), so that no square, sum or difference overflows float32 (values near 1e30 square to 1e60) or
    underflows (tiny weights): finite inputs always give finite figures (`_exponent`). The ratio is scale-free;
    the largest error is scaled back in float64. On the CPU the chunks go to the kernels' thread pool
    (`kernels._compare`); on a GPU they are bitsandbytes' dequantization and a few torch reductions on the
    quantizer's own tensors (`quant_type`, the state's, picks the kernel)."""
    n = source.numel()
    lo, hi = torch.stack(torch.aminmax(absmax)).tolist() if absmax.numel() else (0.0, 0.0)
    exponent = _exponent(hi)
    if not packed.is_cuda:
        raw = packed.reshape(-1).view(torch.uint8)
        pairs = _pair_table(quant_map).view(torch.float64).view(-1)
        # Only the elements actually stored can be compared (see `_dequantized_chunks`).
        err2, ref2, max_err = _compare.error_sums(
            source, raw, absmax, pairs, blocksize, min(n, 2 * raw.numel()), exponent
        )
    else:  # the sums stay on the GPU until the end: one wait for it per tensor, not two per chunk
        sums, maxima = [], []
        for start, end, values in _dequantized_chunks(packed, absmax, quant_map, blocksize, n, quant_type):
            x = _flat_chunk(source, start, end).to(torch.float32, copy=bool(exponent))  # scaled in place
            diff = _scaled(values, exponent).sub_(_scaled(x, exponent))
            sums += [torch.dot(diff, diff), torch.dot(x, x)]
            maxima.append(diff.abs_().max())
        maxima = maxima or [source.new_zeros((), dtype=torch.float32)]  # an empty tensor
        top = maxima[0] if len(maxima) == 1 else torch.stack(maxima).max()  # NaN stays NaN
        *chunks, max_err = torch.stack([*sums, top]).tolist()
        err2 = ref2 = 0.0
        for e, r in zip(chunks[::2], chunks[1::2]):  # in float64, chunk by chunk
            err2 += e
            ref2 += r
    rel = math.sqrt(err2 / ref2) if ref2 > 0 else (0.0 if err2 == 0 else math.inf)
    return TensorStats(n, lo, hi, rel, math.ldexp(max_err, exponent))


# Block scales within 2**±32 of 1 need no scaling: squares stay within 2**±64 and sums of up to 2**40 of them
# within float32's range, and scaling by a power of two would change no figure, only cost two passes per chunk.
SCALE_FREE_EXPONENT = 32


def _exponent(largest: float) -> int:
    """The power of two to scale values by before comparing them: 0 unless the largest block scale is far from 1."""
    exponent = math.frexp(largest)[1]
    return exponent if abs(exponent) > SCALE_FREE_EXPONENT else 0


def _scaled(t: torch.Tensor, exponent: int) -> torch.Tensor:
    """t * 2**-exponent, in place, in two steps so that neither factor overflows float32 (|exponent| <= 149)."""
    if not exponent:
        return t
    half = exponent // 2
    return t.mul_(2.0 ** -half).mul_(2.0 ** -(exponent - half))


def dequantize(packed: torch.Tensor, absmax: torch.Tensor, quant_map: torch.Tensor, blocksize: int, n: int) -> torch.Tensor:
    """The whole dequantized tensor, flat float32 (for small tensors and tests; `compare` streams)."""
    out = torch.zeros(n, dtype=torch.float32, device=packed.device)
    for start, end, values in _dequantized_chunks(packed, absmax, quant_map, blocksize, n):
        out[start:end] = values
    return out


def _dequantized_chunks(
    packed: torch.Tensor, absmax: torch.Tensor, quant_map: torch.Tensor, blocksize: int, n: int,
    quant_type: str | None = None,
) -> Iterator[tuple[int, int, torch.Tensor]]:
    """(start, end, float32 values) over block-aligned chunks of the flat tensor.

    On a GPU, with `quant_type` (the quant state's, naming the table `quant_map` holds), bitsandbytes' float32
    kernel makes each chunk's values in one launch instead of a gather, a scaling and their temporaries: launches
    per tensor are what a model of many small experts costs."""
    raw = packed.reshape(-1).view(torch.uint8)
    # bitsandbytes sizes wide storage dtypes as (n + 1) // (2 * itemsize) elements, which can drop the
    # last byte or two of codes: only the elements that are actually stored can be compared.
    n_stored = min(n, 2 * raw.numel())
    kernel = raw.is_cuda and quant_type in ("nf4", "fp4")
    # One gather per byte gives both of its elements: a 256-entry table of code pairs, each pair of
    # float32 values viewed as one 8-byte item. On the CPU numpy's take does that gather >10x faster
    # than torch's indexing (which also needs the indices widened first).
    pairs = None if kernel else _pair_table(quant_map).view(torch.float64).view(-1)
    pairs_np = None if raw.is_cuda else pairs.numpy()  # type: ignore[union-attr]
    # whole blocks (an even count of elements, so the packed bytes split cleanly)
    step = (GPU_CHUNK_ELEMENTS if raw.is_cuda else CHUNK_ELEMENTS) // blocksize * blocksize
    for start in range(0, n_stored, step):
        end = min(start + step, n_stored)
        codes = raw[start // 2 : (end + 1) // 2]
        first = start // blocksize
        if kernel:
            yield start, end, cuda.dequantize_4bit(codes, absmax[first : -(-end // blocksize)], blocksize,
                                                   quant_type, torch.float32, end - start)  # type: ignore[arg-type]
            continue
        if pairs_np is None:
            values = pairs.index_select(0, codes.int()).view(torch.float32)[: end - start]
        else:
            values = torch.from_numpy(np.take(pairs_np, codes.numpy())).view(torch.float32)[: end - start]
        full = (end - start) // blocksize
        values[: full * blocksize].view(full, blocksize).mul_(absmax[first : first + full, None])
        if full * blocksize < end - start:  # the tensor's last, partial block
            values[full * blocksize :].mul_(absmax[first + full])
        yield start, end, values


def _pair_table(quant_map: torch.Tensor) -> torch.Tensor:
    codes = torch.arange(256, device=quant_map.device)
    table = quant_map.float()
    return torch.stack([table[codes >> 4], table[codes & 15]], dim=1).contiguous()


def _flat_chunk(x: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Elements [start, end) of x in row-major order, copying only the rows they span."""
    if x.is_contiguous():
        return x.view(-1)[start:end]
    cols = x.shape[-1]
    rows = x.reshape(-1, cols)  # a view for the 2-D transposed weights this is used for
    r0, r1 = start // cols, -(-end // cols)
    return rows[r0:r1].reshape(-1)[start - r0 * cols : end - r0 * cols]


def _round(v: float) -> float | None:
    return float(f"{v:.6g}") if math.isfinite(v) else None


class Collector:
    """The pipeline's statistics: every quantized tensor's, by source name."""

    def __init__(self) -> None:
        self.tensors: dict[str, TensorStats] = {}
        self._lock = threading.Lock()

    def inspect(self, step: object, source: torch.Tensor, entries: dict[str, torch.Tensor]) -> None:
        self.add(step, entry_stats(source, entries))

    def add(self, step: object, stats: TensorStats) -> None:
        """Statistics computed elsewhere for `step`'s tensor."""
        with self._lock:
            self.tensors[step.source.name] = stats  # type: ignore[attr-defined]


def summarize(tensors: dict[str, TensorStats]) -> dict:
    """Checkpoint-wide figures for reports and the model card: median and worst relative error."""
    if not tensors:
        return {"tensors": 0}
    errors = sorted((s.rel_error, name) for name, s in tensors.items())
    worst_err, worst = errors[-1]
    worst_abs = max(tensors, key=lambda k: tensors[k].error_ratio)
    return {
        "tensors": len(tensors),
        "median_rel_error": _round(errors[len(errors) // 2][0]),
        "max_rel_error": _round(worst_err),
        "max_rel_error_tensor": worst,
        "max_error_ratio": _round(tensors[worst_abs].error_ratio),
        "max_error_ratio_tensor": worst_abs,
    }


def expected_rel_error(quant_type: str, blocksize: int) -> float:
    """Typical relative L2 error on Gaussian weights for these settings (nearest measured block size)."""
    table = EXPECTED_REL_ERROR.get(quant_type, EXPECTED_REL_ERROR["fp4"])
    return table[min(table, key=lambda b: abs(math.log2(b) - math.log2(max(blocksize, 1))))]
