"""What a conversion did, printed on stdout as text or JSON."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class Summary:
    """What a conversion did; printed on stdout (text or JSON)."""

    output_dir: str
    source: str
    device: str
    input_bytes: int
    output_bytes: int
    tensors_quantized: int
    tensors_kept: int  # as stored
    shards: int
    seconds: float
    peak_gpu_bytes: int | None = None
    unquantized_parameters: dict[str, int] = field(default_factory=dict)
    copied_files: list[str] = field(default_factory=list)
    stats: dict | None = None  # relative error of the dequantized tensors (median, worst), when measured
    hub_commit_url: str | None = None  # with push_to_hub
    already_complete: bool = False  # this conversion was found finished in OUTPUT_DIR: nothing was written
    non_finite: dict[str, dict[str, int]] = field(default_factory=dict)  # kept tensors with NaN / Inf: the counts
    notes: list[str] = field(default_factory=list)  # the plan's notes (e.g. most parameters kept: fused experts)
    tensors_other: dict[str, int] = field(default_factory=dict)  # neither quantized nor kept: {"merged": 4}

    @property
    def gb_per_s(self) -> float | None:
        """The rate the input was converted at; None when nothing was converted (found complete)."""
        if self.already_complete:
            return None
        return self.input_bytes / 1e9 / self.seconds if self.seconds else 0.0

    def to_dict(self) -> dict:
        rate = self.gb_per_s
        d = {**asdict(self), "gb_per_s": None if rate is None else round(rate, 3)}
        for key in ("already_complete", "non_finite", "tensors_other"):  # said only when there is something to say
            if not d[key]:
                del d[key]
        return d

    def to_text(self) -> str:
        others = "".join(f", {n} {done}" for done, n in self.tensors_other.items())
        counts = f"{self.tensors_quantized} tensors quantized, {self.tensors_kept} kept{others}, {self.shards} shard(s)"
        lines = [
            f"already complete: {self.output_dir} holds this conversion, finished earlier; nothing was written ({counts})"
            if self.already_complete else f"wrote {self.output_dir}: {counts}",
            *(f"note: {n}" for n in self.notes),  # first: what most of the output is (MoE experts)
            f"size: {self.input_bytes / 1e9:.3f} GB -> {self.output_bytes / 1e9:.3f} GB "
            f"({self.output_bytes / max(self.input_bytes, 1):.1%})",
        ]
        if (rate := self.gb_per_s) is not None:  # None: no input was read, a rate would be meaningless
            lines.append(f"time: {self.seconds:.1f} s on {self.device}, {_rate(rate * 1e9)} of input")
        lines += [f"unquantized: {n:,} parameters: {why}" for why, n in self.unquantized_parameters.items()]
        if self.stats and self.stats.get("tensors"):
            lines.append(f"error: relative L2 median {self.stats['median_rel_error']}, max {self.stats['max_rel_error']} "
                         f"({self.stats['max_rel_error_tensor']}); sha256 of every file in prequant.json")
        if self.non_finite:
            found = ", ".join(f"{name} ({_counts(counts)})" for name, counts in self.non_finite.items())
            lines.append(f"non-finite values kept as they are: {found} (recorded in prequant.json)")
        if self.hub_commit_url:
            lines.append(f"uploaded: {self.hub_commit_url}")
        return "\n".join(lines)


def _counts(counts: dict[str, int]) -> str:
    """'3 NaN, 12 Inf'"""
    return ", ".join(f"{counts[kind]:,} {label}" for kind, label in (("nan", "NaN"), ("inf", "Inf")) if counts.get(kind))


def _rate(bytes_per_s: float) -> str:
    """A read rate with three significant digits in a unit that shows them (a tiny input is not "0.00 GB/s")."""
    for unit, size in (("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
        if bytes_per_s >= size:
            return f"{bytes_per_s / size:.3g} {unit}"
    return f"{bytes_per_s:.0f} B/s"
