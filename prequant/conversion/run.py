"""`convert()`: the whole pipeline, one named step per line.

    check OUTPUT_DIR -> resolve SOURCE -> read its headers -> decide the layout -> plan -> claim OUTPUT_DIR
    -> stream the shards (read, quantize, write) -> config, index, side files, manifest and card -> publish
    -> (verify and upload)

From the claim on, `run_job`: the frame `convert()` and `merging.run.merge()` share, each with its own writing step.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from .._version import __version__
from ..bnb import starting
from ..bnb.layout import require_known
from ..bnb.predict import decide
from ..bnb.quantize import Quantizer, check_device
from ..bnb.starting import Starting
from ..checkpoint import manifest, quantized
from ..checkpoint.tensors import TensorRef
from ..errors import Interrupted, flag
from ..source.resolve import contents, reader, resolve
from ..source.spec import Source
from ..util import gcpause, signals, trace
from ..util.progress import Progress
from . import card, output, pipeline, readahead
from .journal import Journal, fingerprint, job_id
from .options import ConvertOptions
from .plan import Plan, Step, make_plan
from .record import Recorder, copy_side_files, recorded_options, side_files, write_config, write_index
from .summary import Summary

if TYPE_CHECKING:
    from ..hub.upload import Publisher


@dataclass(frozen=True)
class Job:
    """One planned conversion (or merge), as `convert()` (or `merge()`) hands it to `run_job` and on."""

    source: Source
    output_dir: Path
    options: ConvertOptions
    tensors: list[TensorRef]  # every source tensor, in file order
    config: dict  # the source's config.json
    plan: Plan
    fingerprint: dict  # what an interrupted run and the run continuing it share (the journal's job.json)
    side_files: list[Path]  # the source's other files to carry over, relative
    started: float  # time.monotonic() at the call

    @classmethod
    def planned(cls, source: Source, output_dir: Path, options: ConvertOptions, tensors: list[TensorRef],
                config: dict, plan: Plan, started: float, **also: Any) -> Job:
        """The job of `plan`: its fingerprint (the plan, a local source's files, prequant's version, a Hub source's
        commit, and `also`: what else a rerun must share, such as a merge's adapter) and the side files to carry."""
        files = () if source.hub else source.weight_files
        return cls(source, output_dir, options, tensors, config, plan,
                   fingerprint(plan, files, __version__) | source.pin() | also, side_files(source.path), started)

    @property
    def id(self) -> str:
        """The fingerprint as one string, recorded in prequant.json (a rerun then knows a finished job)."""
        return job_id(self.fingerprint)


def convert(
    source: str | Path, output_dir: str | Path, options: ConvertOptions | None = None, **changes: Any
) -> Summary | Plan:
    """Convert a checkpoint to bitsandbytes 4-bit, streaming one tensor at a time.

    Options come as a `ConvertOptions`, or as its fields by keyword (`quant_type="fp4", device="cpu"`, ...), which
    override `options`. Returns the Plan when `dry_run`, else the Summary. Raises PrequantError with a one-line
    message on any bad input; OUTPUT_DIR then holds no checkpoint-looking files. After an interruption (SIGINT,
    SIGTERM, SIGKILL, a full disk), the same call continues where it stopped and gives the same bytes as an
    uninterrupted run; once finished, it says the output is complete (`Summary.already_complete`).

    A Hub source (`org/name[@revision]` or an alias) is planned from its shards' headers and its shards are
    downloaded one by one as the conversion reaches them; `delete_source_shards` evicts each one from the
    Hugging Face cache once converted (about two source shards on disk at a time).
    """
    opts = replace(options or ConvertOptions(), **changes)
    started = time.monotonic()
    out = output.target(output_dir, source, overwrite=opts.overwrite, resume=opts.resume, dry_run=opts.dry_run)
    with gcpause.paused():  # the plan's objects stay alive: no collector rescanning them as they are made
        src = resolve(str(source), stream=True, delete=opts.delete_source_shards)
        held = contents(src)
        check_device(opts.device)  # a dry run refuses what the real run would, without starting CUDA
        # CUDA and bitsandbytes start on a thread while the layout is decided and the plan made; the pipeline waits.
        weight_bytes = sum(t.nbytes for t in held.tensors)  # what `--device auto` weighs
        quantizer = None if opts.dry_run else starting.quantizer(opts.settings, opts.device, weight_bytes)
        trace.mark("quantizer-started")  # on a GPU, "cuda-ready" follows once it is built
        plan = _plan(held.config, src.path, held.tensors, opts)
        if opts.dry_run:
            return plan
        job = Job.planned(src, out, opts, held.tensors, held.config, plan, started)
    return run_job(job, quantizer, partial(_write, job, quantizer), stats=opts.stats,
                   record_options={"skip": list(opts.skip), "max_shard_size": opts.shard_limit},
                   notes=partial(_base_model_hint, opts))


def run_job(job: Job, quantizer: Quantizer | Starting,
            write: Callable[[Recorder, Path, Callable], None], *, stats: bool, record_options: dict,
            notes: Callable[[dict], list[str]]) -> Summary:
    """A planned job from the claim on: OUTPUT_DIR claimed, the output written into the claim's staging folder
    (unless a previous run finished it) and published; with --push-to-hub the repo is created (or refused) before
    any work and what the Hub lacks is sent in one commit at the end. SIGINT and SIGTERM stop it as Interrupted;
    the same job run again continues. `write(record, staging, stream)` is the caller's writing step: `stream(
    transform=None)` reads, [transforms,] quantizes and writes every tensor, the index and the side files; then
    config.json, the card and, through `record` (options: `stats`, `record_options`), the manifest.
    Returns the Summary, with `notes(manifest)` when this run wrote the output."""
    opts, out = job.options, job.output_dir
    publisher = None
    if opts.push_to_hub:  # the repo created (or refused) before any work; huggingface_hub is imported only then
        from ..verify import publish

        publisher = publish.publisher(opts.push_to_hub, private=opts.private, progress=opts.progress)
    with publisher or nullcontext():
        recorded = recorded_options(job.plan, record_options, stats=stats, allow_nan=opts.allow_nan)
        with output.claim(out, job.fingerprint, overwrite=opts.overwrite, resume=opts.resume, options=recorded) as claim:
            if not claim.complete:  # else finished before; an interrupted push goes on below
                with _interruptible(), Recorder(job.source, job.plan, recorded, job=job.id) as record:
                    if not output.publishing(claim.staging):  # else an interrupted run had written everything
                        write(record, claim.staging, partial(_stream, job, quantizer, record, claim.staging, publisher))
                        trace.mark("manifest-written")
                    output.publish(out, claim.staging)
                    trace.mark("published")
        if opts.overwrite and opts.progress and (others := output.unrelated_files(out)):
            more = f" and {len(others) - 1} more" if len(others) > 1 else ""
            print(f"prequant: warning: {out} also holds {others[0]}{more}, which {flag('overwrite')} keeps and this output "
                  "does not list: `prequant upload` refuses a folder holding files that are not part of it; move them "
                  "out before uploading", file=sys.stderr)
        hub_url = None
        if publisher is not None:  # verified, then what the Hub lacks is sent, in one commit
            hub_url = publish.push_converted(out, opts.push_to_hub, progress=opts.progress, publisher=publisher)
    written = manifest.load(out)
    if claim.complete:
        return _summary(job, written, complete=True, hub_url=hub_url)
    return _summary(job, written, hub_url=hub_url, quantizer=quantizer, notes=notes(written))


def _write(job: Job, quantizer: Quantizer | Starting, record: Recorder, staging: Path, stream: Callable) -> None:
    """Stream the shards (with their index and the side files), then write config, card and manifest."""
    stream()
    write_config(staging, job.config, job.plan)
    record.finish(staging, job.side_files, device=str(quantizer.device), repo_id=job.options.push_to_hub,
                  base=job.options.base_model)


def _base_model_hint(opts: ConvertOptions, written: dict) -> list[str]:
    """The note for a card that names no base model: one of the summary's notes (on stdout with the summary)."""
    hint = card.base_model_note(written, opts.said("base_model", "org/name"))
    return [hint] if hint else []


def _plan(config: dict, source_dir: Path, tensors: list[TensorRef], opts: ConvertOptions) -> Plan:
    """Every output, planned on the layout transformers decides (from names alone where that is settled)."""
    layout, settled = decide(config, source_dir, tensors, list(opts.skip), opts.trust_remote_code)
    require_known(layout)
    plan = replace(make_plan(tensors, layout, opts.settings, opts.shard_limit, opts.skip, opts.quantize_experts), settled=settled)
    trace.mark("planned")
    if opts.progress and not opts.dry_run:  # a dry run's plan says them
        for warning in plan.warnings:
            print(f"prequant: warning: {warning}", file=sys.stderr)
    return plan


def _stream(job: Job, quantizer: Quantizer | Starting, record: Recorder, staging: Path,
            publisher: Publisher | None = None, transform: pipeline.Transform | None = None) -> None:
    """Read, quantize and write every tensor into the staging folder, journaled so that a rerun continues, then the
    index and the side files. The disk reads ahead of the pipeline (local files); a Hub source's shards are
    downloaded as the pipeline reaches them; with --push-to-hub each shard is uploaded once sealed. `transform`: a
    merge's change to tensors before they are quantized."""
    src, plan, opts = job.source, job.plan, job.options
    journal = Journal(staging, job.fingerprint)
    record.kept.found.update(journal.done.non_finite)  # what the interrupted run found in the tensors it wrote
    if journal.resumed and opts.progress:
        print(f"prequant: resuming: {len(journal.done.steps)} of {len(plan.steps)} tensors done", file=sys.stderr)
    # A resumed run's downloads start at its first read, once the journal has marked what is done.
    data = reader(src, job.tensors, delete=opts.delete_source_shards, start=not journal.resumed)
    if opts.delete_source_shards:  # the shards an interrupted run downloaded are this run's to delete
        data.claim(journal.done.downloaded)
        data.on_download(journal.source_downloaded)
    ahead = None if src.hub is not None else readahead.start(list(src.weight_files))
    try:
        with data, Progress(plan.source_bytes, enabled=opts.progress) as bar:  # the bytes on disk (quantized weights as stored)
            def on_step(step: Step) -> None:
                read = sum(piece.nbytes for piece in quantized.pieces(step.source))
                bar.advance(read)
                if ahead is not None:
                    ahead.consumed(read)
                data.tensor_done(step.source)  # a Hub shard: evicted after its last tensor with --delete-source-shards

            def on_shard(name: str, file: BinaryIO) -> None:
                record.on_shard(name, file)
                if publisher is not None:  # sealed in staging, or already moved to OUTPUT_DIR
                    publisher.send(name, (staging / name, job.output_dir / name), lambda: record.digest(name))

            trace.mark("pipeline-start")
            # The card's library, while the disk is what the stream waits for; after CUDA's start, which its
            # imports would otherwise slow down (they compete for the interpreter and its import locks).
            starting.after_start(quantizer, card.import_ahead)
            sizes = pipeline.run(plan, data, quantizer, staging, journal, on_step=on_step, stats=record.stats,
                                 on_shard=on_shard, check=record.kept, on_follow=record.on_follow,
                                 transform=transform)
            trace.mark("pipeline-end")
    finally:
        if ahead is not None:
            ahead.stop()
        journal.close()
    copy_side_files(src.path, staging, job.side_files)
    write_index(staging, plan, sizes)


def _summary(job: Job, written: dict, *, complete: bool = False, hub_url: str | None = None,
             quantizer: Quantizer | Starting | None = None, notes: list[str] | None = None) -> Summary:
    out, plan = job.output_dir, job.plan
    device = quantizer.device if quantizer is not None else None
    quantized, kept, others = plan.tensor_counts()
    return Summary(
        output_dir=str(out),
        source=job.source.describe(),
        device=str(device) if device is not None else written.get("device", "cpu"),
        input_bytes=plan.source_bytes,
        output_bytes=sum((out / name).stat().st_size for name in plan.shards),
        tensors_quantized=quantized,
        tensors_kept=kept,
        tensors_other=others,
        shards=len(plan.shards),
        seconds=time.monotonic() - job.started,
        peak_gpu_bytes=_peak_gpu_bytes(device),
        unquantized_parameters=plan.unquantized(),
        notes=[*plan.all_notes(), *(notes or [])],
        copied_files=[p.as_posix() for p in job.side_files],
        stats=written["stats"]["summary"],
        hub_commit_url=hub_url,
        already_complete=complete,
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


def _peak_gpu_bytes(device: Any) -> int | None:
    if device is None or device.type != "cuda":
        return None
    import torch

    return torch.cuda.max_memory_reserved(device)
