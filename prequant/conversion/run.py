"""`convert()`: the whole pipeline, one named step per line.

    resolve SOURCE -> scan its tensors -> decide the layout -> plan -> stream shards (read, quantize, write)
    -> config, index, side files -> manifest and card -> publish -> (verify and upload)
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

from .._version import __version__
from ..bnb import starting, tensor_pool
from ..bnb.layout import Layout, require_known
from ..bnb.predict import prediction
from ..bnb.quantize import Quantizer, check_device
from ..bnb.starting import Starting
from ..checkpoint import manifest
from ..checkpoint.reader import TensorReader
from ..checkpoint.tensors import TensorRef
from ..errors import Interrupted, PrequantError
from ..source import hub_early
from ..source.resolve import contents, reader, resolve
from ..source.spec import Source
from ..util import signals, trace
from ..util.progress import Progress
from . import output, pipeline, readahead
from .journal import Journal, fingerprint, job_id
from .layouts import LayoutMismatch, Layouts
from .options import ConvertOptions
from .plan import Plan, Step, make_plan
from .record import Recorder
from .sidecar import copy_side_files, side_files, write_config, write_index
from .summary import Summary


def convert(
    source: str | Path, output_dir: str | Path, options: ConvertOptions | None = None, **changes: Any
) -> Summary | Plan:
    """Convert a checkpoint to bitsandbytes 4-bit, streaming one tensor at a time.

    Options come as a `ConvertOptions`, or as its fields by keyword (`quant_type="fp4", device="cpu"`, ...), which
    override `options`. Returns the Plan when `dry_run`, else the Summary. Raises PrequantError with a one-line
    message on any bad input; OUTPUT_DIR then holds no checkpoint-looking files. After an interruption (SIGINT,
    SIGTERM, SIGKILL, a full disk), the same call with `resume=True` continues where it stopped and gives the
    same bytes as an uninterrupted run.

    A Hub source (`org/name[@revision]` or an alias) is planned from its shards' headers and its shards are
    downloaded one by one as the conversion reaches them; `delete_source_shards` evicts each one from the
    Hugging Face cache once converted (about two source shards on disk at a time).
    """
    try:
        return _convert(source, output_dir, replace(options or ConvertOptions(), **changes))
    finally:
        # The CPU workers end with the conversion: each holds its own torch (150-285 MiB), which a long-lived
        # process (a notebook, a service) should not keep holding after convert() returns. So does a download the
        # CLI began early (`source.hub_early`) that the conversion stopped before taking over.
        tensor_pool.close()
        hub_early.close()


def _convert(source: str | Path, output_dir: str | Path, opts: ConvertOptions) -> Plan | Summary:
    started = time.monotonic()
    src = resolve(str(source), stream=True, delete=opts.delete_source_shards)
    # OUTPUT_DIR is refused before any header of the source is read (a Hub source's by range requests).
    out = output.target(output_dir, src.path, overwrite=opts.overwrite, resume=opts.resume, dry_run=opts.dry_run)
    held = contents(src)
    tensors = held.tensors
    config = held.config
    check_device(opts.device)  # a dry run refuses what the real run would, without starting CUDA
    # CUDA and bitsandbytes start on a thread while the pipeline runs, the CPU quantizing meanwhile (bnb.starting),
    # unless this process started with its libraries cold (as the CLI found before torch's import: its start-up
    # read-ahead for a local source, `readahead.note_cold_start` for a Hub one): CUDA's start then reads them page
    # fault by page fault, behind the pipeline's reads and writes, and took 29 s beside them against 4-12 s with the
    # pipeline waiting (a 33 GB Grok-shaped checkpoint, `scripts/bench/convert.py --size-gb 33 --shape grok
    # --device cuda`, the GPU machine); quantizing meanwhile all the same (PREQUANT_CPU_WHILE_CUDA_STARTS=1) came out
    # even with waiting, both bound by the disk (`bnb.starting`).
    # A Hub source's first shard downloads from here on, while the quantizer starts and the layout is decided (the
    # plan reads the tensors in this order); a resume starts at its first read, once the journal has said what is
    # done.
    data = None if opts.dry_run else reader(src, tensors, delete=opts.delete_source_shards, start=not opts.resume)
    try:
        # Where the architecture is known, the layout is predicted from names: settled (transformers' own, see
        # conversion.layouts) or a head start the pipeline runs on while transformers decides its own (a dry run
        # prints, and a resume's journal fixes, transformers' plan: they wait for it unless settled; so does a run
        # that deletes its downloaded shards, which a restart on another layout would download again).
        foreseen = prediction(config, tensors, list(opts.skip), opts.trust_remote_code,
                              head_start=not (opts.dry_run or opts.resume or opts.delete_source_shards))
        weight_bytes = _src_bytes(tensors)
        quantizer = None if opts.dry_run else starting.quantizer(
            opts.settings, opts.device, weight_bytes, cold=readahead.found_libraries_cold())
        if quantizer is not None and quantizer.device_type == "cpu":
            tensor_pool.pool(weight_bytes)  # the CPU workers import torch while the plan is made
        trace.mark("quantizer-ready")
        layouts = Layouts(foreseen, config, src.path, tensors, list(opts.skip), opts.trust_remote_code)
        try:
            return _run(out, src, tensors, config, quantizer, layouts.first, layouts, opts, started, data)
        except LayoutMismatch:  # transformers decided otherwise: nothing was published; its layout wins, start again
            data.close()  # a fresh reader: the first one counted the tensors already written
            data = reader(src, tensors, delete=opts.delete_source_shards, start=not opts.resume)
            return _run(out, src, tensors, config, quantizer, layouts.final(), None, opts, started, data)
    finally:
        if data is not None:
            data.close()


def _run(out: Path, src: Source, tensors: list[TensorRef], config: dict, quantizer: Quantizer | Starting | None, layout: Layout,
         layouts: Layouts | None, opts: ConvertOptions, started: float, data: TensorReader | None) -> Summary | Plan:
    """Plan on `layout` and convert (checked against transformers' by `layouts` before publishing, when it is a
    prediction) with `data` reading the source; return the Plan for a dry run, else the Summary."""
    try:
        plan = replace(_plan(tensors, layout, opts), settled=layouts is not None and layouts.settled)
        trace.mark("planned")
        if opts.dry_run:
            return plan
        job = fingerprint(plan, () if src.hub else src.weight_files, __version__) | src.pin()
        side = side_files(src.path)
        with output.claim(out, job_id(job), overwrite=opts.overwrite, resume=opts.resume) as claim:  # locked till published
            written = None if claim.complete else _convert_into(out, src, data, plan, config, quantizer, job, side,
                                                                opts, layouts)
    except PrequantError as e:
        if layouts is None or not layouts.pending or isinstance(e, Interrupted):
            raise
        layouts.confirm()  # refused on a prediction: transformers' own refusal, or its other layout, comes first
        raise
    hub_url = _push(out, opts) if opts.push_to_hub else None
    return _summary(out, src, plan, quantizer, started, side, written or manifest.load(out), hub_url, claim.complete)


def _convert_into(out: Path, src: Source, data: TensorReader, plan: Plan, config: dict,
                  quantizer: Quantizer | Starting, job: dict, side: list[Path], opts: ConvertOptions,
                  layouts: Layouts | None) -> dict | None:
    """Stream the shards, check a predicted layout against transformers', write config, index, side files and
    manifest into the staging folder, publish; return the manifest (None when an earlier, interrupted run had
    written everything and was publishing)."""
    record = Recorder(src, plan, stats=opts.stats, job=job_id(job), allow_nan=opts.allow_nan,
                      options={"skip": list(opts.skip), "max_shard_size": opts.shard_limit})
    staging = output.staging_dir(out, keep=opts.resume)
    written = None
    with _interruptible(), record:
        if not (opts.resume and output.publishing(staging)):
            shard_sizes = _write_shards(src, data, plan, quantizer, staging, record, job, opts)
            if layouts is not None:
                layouts.confirm()  # the layout transformers decides, before anything is published
            copy_side_files(src.path, staging, side)
            write_index(staging, plan, shard_sizes)
            write_config(staging, config, plan)
            written = record.finish(staging, side, device=str(quantizer.device), repo_id=opts.push_to_hub,
                                    base=opts.base_model)
            trace.mark("manifest-written")
        output.publish(out, staging)
        trace.mark("published")
    return written


def _src_bytes(tensors: list[TensorRef]) -> int:
    """The source's weights in bytes (what `--device auto` weighs)."""
    return sum(t.nbytes for t in tensors)


def _plan(tensors: list[TensorRef], layout: Layout, opts: ConvertOptions) -> Plan:
    """Plan every output from the layout (which tensors become 4-bit)."""
    require_known(layout)
    plan = make_plan(tensors, layout, opts.settings, opts.shard_limit, opts.quantize_experts)
    if opts.progress and not opts.dry_run:  # a dry run's plan says them
        for warning in plan.warnings:
            print(f"prequant: warning: {warning}", file=sys.stderr)
    return plan


def _write_shards(
    src: Source, data: TensorReader, plan: Plan, quantizer: Quantizer | Starting, staging: Path, record: Recorder,
    job: dict, opts: ConvertOptions,
) -> dict[str, int]:
    """Stream every tensor through the pipeline into the staging folder, journaled for --resume; return each
    shard's data bytes. The disk is kept reading ahead of the pipeline (local files) and a Hub source's shards
    are downloaded as it reaches them."""
    journal = Journal(staging, job, resume=opts.resume)
    record.kept.found.update(journal.done.non_finite)  # what the interrupted run found in the tensors it wrote
    if journal.resumed and opts.progress:
        print(f"prequant: resuming, {len(journal.done.steps)} of {len(plan.steps)} tensors already done",
              file=sys.stderr)
    if src.hub is not None and opts.delete_source_shards:  # a Hub source's reader is a HubShardReader
        data.claim(journal.done.downloaded)  # type: ignore[attr-defined]
        data.on_download(journal.source_downloaded)  # type: ignore[attr-defined]
    window = readahead.pipeline_window(quantizer.device_type)
    ahead = readahead.start(list(src.weight_files), window=window) if src.hub is None else None
    try:
        with data, Progress(plan.input_bytes, enabled=opts.progress) as bar:
            hooks: list[Callable[[TensorRef], Any]] = [lambda ref: bar.advance(ref.nbytes)]
            if ahead is not None:
                hooks.append(lambda ref: ahead.consumed(ref.nbytes))
            hooks.append(data.tensor_done)  # a Hub shard: evicted after its last tensor with --delete-source-shards
            trace.mark("pipeline-start")
            sizes = pipeline.run(plan, data, quantizer, staging, journal, on_step=_each(hooks),
                                 stats=record.stats, on_shard=record.on_shard, check=record.kept,
                                 on_follow=record.on_follow)
            trace.mark("pipeline-end")
            return sizes
    finally:
        if ahead is not None:
            ahead.stop()
        journal.close()


def _push(out: Path, opts: ConvertOptions) -> str:
    """Verify and upload (huggingface_hub is imported only then: a third of a second of start-up otherwise)."""
    from ..verify.publish import push_converted

    return push_converted(out, opts.push_to_hub, progress=opts.progress)


def _each(hooks: list[Callable[[TensorRef], Any]]) -> Callable[[Step], None]:
    """One on_step hook calling each of `hooks` with the step's source tensor."""
    def on_step(step: Step) -> None:
        for hook in hooks:
            hook(step.source)

    return on_step


def _summary(out: Path, src: Source, plan: Plan, quantizer: Quantizer | Starting, started: float, side: list[Path],
             written: dict, hub_url: str | None, already_complete: bool) -> Summary:
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
        notes=plan.all_notes(),
        copied_files=[p.as_posix() for p in side],
        stats=written["stats"]["summary"],
        hub_commit_url=hub_url,
        already_complete=already_complete,
        non_finite=written.get("non_finite") or {},
    )


@contextmanager
def _interruptible() -> Iterator[None]:
    """SIGINT and SIGTERM stop the conversion cleanly (threads joined, journal flushed) as Interrupted.

    The CLI has every signal raise `signals.Signalled` from start-up on; a library caller gets that for SIGTERM
    here, for the span of the conversion, when nothing else handles it (Python raises KeyboardInterrupt for
    SIGINT already). Either is a KeyboardInterrupt, which no `except Exception` on the way swallows."""
    main = threading.current_thread() is threading.main_thread()
    install = main and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    previous = signal.signal(signal.SIGTERM, signals.raising) if install else None
    try:
        yield
    except KeyboardInterrupt as e:
        signum = signals.of(e)
        raise Interrupted(signals.name(signum), signals.exit_code(signum)) from None
    finally:
        if install:
            signal.signal(signal.SIGTERM, previous)


def _peak_gpu_bytes(device) -> int | None:
    import torch

    return torch.cuda.max_memory_reserved(device) if device.type == "cuda" else None
