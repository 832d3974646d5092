"""`convert()`: the whole pipeline, one named step per line."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from . import architectures, metadata, output, pipeline, reader
from . import source as sources
from .plan import Plan, Settings, make_plan, parse_size
from .progress import Progress
from .quantize import Quantizer, pick_device


@dataclass
class Summary:
    """What a conversion did; printed on stdout (text or JSON)."""

    output_dir: str
    source: str
    device: str
    input_bytes: int
    output_bytes: int
    tensors_quantized: int
    tensors_kept: int
    shards: int
    seconds: float
    unquantized_parameters: dict[str, int] = field(default_factory=dict)
    copied_files: list[str] = field(default_factory=list)

    @property
    def gb_per_s(self) -> float:
        return self.input_bytes / 1e9 / self.seconds if self.seconds else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "gb_per_s": round(self.gb_per_s, 3)}

    def to_text(self) -> str:
        lines = [
            f"wrote {self.output_dir}: {self.tensors_quantized} tensors quantized, {self.tensors_kept} kept, "
            f"{self.shards} shard(s)",
            f"size: {self.input_bytes / 1e9:.3f} GB -> {self.output_bytes / 1e9:.3f} GB "
            f"({self.output_bytes / max(self.input_bytes, 1):.1%})",
            f"time: {self.seconds:.1f} s on {self.device}, {self.gb_per_s:.2f} GB/s of input",
        ]
        lines += [f"unquantized: {n:,} parameters ({why})" for why, n in self.unquantized_parameters.items()]
        return "\n".join(lines)


def convert(
    source: str | Path,
    output_dir: str | Path,
    *,
    quant_type: str = "nf4",
    double_quant: bool = True,
    blocksize: int = 64,
    compute_dtype: str = "bfloat16",
    quant_storage: str = "bfloat16",
    skip: Sequence[str] = (),
    max_shard_size: str | int = "5GB",
    device: str = "auto",
    dry_run: bool = False,
    overwrite: bool = False,
    trust_remote_code: bool = False,
    progress: bool = True,
) -> Summary | Plan:
    """Convert a checkpoint to bitsandbytes 4-bit, streaming one tensor at a time.

    Returns the Plan when `dry_run`, else the Summary. Raises PrequantError with a one-line message
    on any bad input; OUTPUT_DIR then holds no checkpoint-looking files.
    """
    started = time.monotonic()
    settings = Settings(quant_type, double_quant, blocksize, compute_dtype, quant_storage)
    shard_limit = parse_size(max_shard_size)
    src = sources.resolve(str(source))
    out = Path(output_dir)
    if not dry_run:
        output.check(out, overwrite)
    tensors = reader.scan(src.weight_files)
    if src.index_file is not None:
        reader.check_index(src.index_file, tensors)
    config = metadata.read_config(src.path)
    layout = architectures.analyze(config, src.path, tensors, list(skip), trust_remote_code)
    architectures.require_known(layout)
    plan = make_plan(tensors, layout, settings, shard_limit)
    if dry_run:
        return plan

    quantizer = Quantizer(settings, pick_device(device))
    staging = output.staging_dir(out)
    with reader.TensorSource() as data, Progress(plan.input_bytes, enabled=progress) as bar:
        shard_sizes = pipeline.run(plan, data, quantizer, staging, on_step=lambda s: bar.advance(s.source.nbytes))
    side = metadata.side_files(src.path)
    metadata.copy_side_files(src.path, staging, side)
    metadata.write_index(staging, plan, shard_sizes)
    metadata.write_config(staging, config, plan)
    output.publish(out, staging)

    return Summary(
        output_dir=str(out),
        source=src.describe(),
        device=str(quantizer.device),
        input_bytes=plan.input_bytes,
        output_bytes=sum((out / name).stat().st_size for name in plan.shards),
        tensors_quantized=sum(s.quantize for s in plan.steps),
        tensors_kept=sum(not s.quantize for s in plan.steps),
        shards=len(plan.shards),
        seconds=time.monotonic() - started,
        unquantized_parameters=plan.unquantized(),
        copied_files=[p.as_posix() for p in side],
    )
