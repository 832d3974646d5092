"""`convert()`: the whole pipeline, one named step per line."""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

from . import __version__, architectures, layout_worker, metadata, output, pipeline, reader, readahead, trace
from . import source as sources
from . import manifest
from . import publish
from .errors import Interrupted
from .journal import Journal, fingerprint
from .plan import Plan, Settings, Step, make_plan, parse_size
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
    peak_gpu_bytes: int | None = None
    unquantized_parameters: dict[str, int] = field(default_factory=dict)
    copied_files: list[str] = field(default_factory=list)
    stats: dict | None = None  # relative error of the dequantized tensors (median, worst), when measured
    hub_commit_url: str | None = None  # with push_to_hub

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
        if self.stats and self.stats.get("tensors"):
            lines.append(f"error: relative L2 median {self.stats['median_rel_error']}, max {self.stats['max_rel_error']} "
                         f"({self.stats['max_rel_error_tensor']}); sha256 of every file in prequant.json")
        if self.hub_commit_url:
            lines.append(f"uploaded: {self.hub_commit_url}")
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
    resume: bool = False,
    trust_remote_code: bool = False,
    progress: bool = True,
    stats: bool = True,
    push_to_hub: str | None = None,
    delete_source_shards: bool = False,
) -> Summary | Plan:
    """Convert a checkpoint to bitsandbytes 4-bit, streaming one tensor at a time.

    Returns the Plan when `dry_run`, else the Summary. Raises PrequantError with a one-line message
    on any bad input; OUTPUT_DIR then holds no checkpoint-looking files. After an interruption (SIGINT,
    SIGTERM, SIGKILL, a full disk), the same call with `resume=True` continues where it stopped and
    gives the same bytes as an uninterrupted run.

    A Hub source (`org/name[@revision]` or an alias) is planned from its shards' headers and its shards are
    downloaded one by one as the conversion reaches them; `delete_source_shards` evicts each one from the
    Hugging Face cache once converted (about two source shards on disk at a time).
    """
    started = time.monotonic()
    settings = Settings(quant_type, double_quant, blocksize, compute_dtype, quant_storage)
    shard_limit = parse_size(max_shard_size)
    src = sources.resolve(str(source), stream=True)
    sources.check_delete(src, delete_source_shards)
    out = Path(output_dir)
    if not dry_run:
        output.check_not_source(out, src.path)
        output.check(out, overwrite or resume)
    tensors = sources.scan(src)
    if src.index_file is not None:
        reader.check_index(src.index_file, tensors)
    config = metadata.read_config(src.path)
    # The GPU and bitsandbytes start up while a child process started by the CLI decides the layout.
    quantizer = None if dry_run else Quantizer(settings, pick_device(device))
    trace.mark("quantizer-ready")
    layout = (layout_worker.take(src.path, tensors, list(skip), trust_remote_code)
              or architectures.analyze(config, src.path, tensors, list(skip), trust_remote_code))
    architectures.require_known(layout)
    plan = make_plan(tensors, layout, settings, shard_limit)
    trace.mark("planned")
    if dry_run:
        return plan
    record = manifest.Recorder(src, plan, stats=stats, options={"skip": list(skip), "max_shard_size": shard_limit})
    staging = output.staging_dir(out, keep=resume)
    side = metadata.side_files(src.path)
    manifest_written: dict | None = None  # None: published by an earlier, interrupted run
    with _interruptible(), record:
        if not (resume and output.publishing(staging)):
            job = fingerprint(plan, () if src.hub else src.weight_files, __version__) | src.pin()
            journal = Journal(staging, job, resume=resume)
            if journal.resumed and progress:
                print(f"prequant: resuming, {len(journal.done.steps)} of {len(plan.steps)} tensors already done",
                      file=sys.stderr)
            ahead = readahead.start(list(src.weight_files)) if src.hub is None else None
            data = sources.tensors(src, plan.steps, delete=delete_source_shards)

            def done(step: Step) -> None:
                bar.advance(step.source.nbytes)
                if ahead is not None:
                    ahead.consumed(step.source.nbytes)
                data.step_done(step)  # a Hub shard: evicted after its last tensor with delete_source_shards

            try:
                with data, Progress(plan.input_bytes, enabled=progress) as bar:
                    trace.mark("pipeline-start")
                    shard_sizes = pipeline.run(
                        plan, data, quantizer, staging, journal, on_step=done,
                        inspect=record.inspect, on_shard=record.on_shard,
                    )
                    trace.mark("pipeline-end")
            finally:
                if ahead is not None:
                    ahead.stop()
                journal.close()
            metadata.copy_side_files(src.path, staging, side)
            metadata.write_index(staging, plan, shard_sizes)
            metadata.write_config(staging, config, plan)
            manifest_written = record.finish(staging, side, device=str(quantizer.device), repo_id=push_to_hub)
            trace.mark("manifest-written")
        output.publish(out, staging)
        trace.mark("published")
    hub_url = publish.push_converted(out, push_to_hub, progress=progress) if push_to_hub else None

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
        peak_gpu_bytes=_peak_gpu_bytes(quantizer.device),
        unquantized_parameters=plan.unquantized(),
        copied_files=[p.as_posix() for p in side],
        stats=(manifest_written or manifest.load(out))["stats"]["summary"],
        hub_commit_url=hub_url,
    )


@contextmanager
def _interruptible() -> Iterator[None]:
    """SIGINT and SIGTERM stop the conversion cleanly (threads joined, journal flushed) as Interrupted."""
    def on_term(signum: int, frame: object) -> None:
        raise Interrupted("SIGTERM", 128 + signal.SIGTERM)

    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, on_term) if main else None
    try:
        yield
    except KeyboardInterrupt:
        raise Interrupted("SIGINT", 128 + signal.SIGINT) from None
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)


def _peak_gpu_bytes(device) -> int | None:
    import torch

    return torch.cuda.max_memory_reserved(device) if device.type == "cuda" else None
