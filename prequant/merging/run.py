"""`merge()`: a LoRA adapter merged into its base, streaming one tensor at a time: a conversion whose pipeline
changes the adapter's targets on the device (`Merger`, the pipeline's transform) before writing or quantizing them.

    open the adapter (its config checked) -> check OUTPUT_DIR -> resolve the base -> read its headers (a 4-bit
    base's quant states checked as verify checks them) -> match the adapter's keys and check each tensor against
    its target, as peft does -> plan -> claim OUTPUT_DIR -> stream (read, merge, [quantize,] write) -> config,
    index, side files, card, manifest -> publish -> (verify and upload)

Everything the merge refuses is refused before OUTPUT_DIR is claimed, so a rerun with a good adapter needs no
--overwrite. The job is known by its inputs' content (the adapter's files by their sha256, the base's as a
conversion knows its source), not by how a path was typed.

The base is a 16-bit or FP8 checkpoint (local, Hub, `.bin`) or a prequant 4-bit output. The output is 16-bit: the
base's dtypes, a 4-bit base's weights dequantized to their quant state's dtype; or with `quantize`, 4-bit: a 4-bit
base's settings (untargeted 4-bit weights copied as stored), a 16-bit base's as `convert` would quantize it.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..bnb import starting
from ..bnb.format import Settings, settings_entries
from ..bnb.layout import Decision, Layout, require_known
from ..bnb.loading import load_dtype
from ..bnb.predict import decide
from ..bnb.quantize import check_device
from ..checkpoint import manifest
from ..checkpoint.hf_files import CARD, CONFIG, INDEX_NAMES
from ..checkpoint.reader import TensorReader
from ..checkpoint.tensors import TensorRef
from ..conversion import output
from ..conversion.options import ConvertOptions
from ..conversion.plan import OutTensor, Plan, Step, make_plan
from ..conversion.record import KeptCheck, Recorder, source_identity, write_config
from ..conversion.run import Job, run_job
from ..conversion.summary import Summary
from ..errors import PrequantError, UsageError, flag, on_command_line, spelled
from ..source.resolve import contents, resolve, scan
from ..source.spec import Source, hub_spec
from ..util import trace
from ..util.fsio import write_json
from ..verify.check import Report, check_quantized
from . import card, folder
from .adapter import Adapter, Target, base_names, read, targets, wanted
from .folder import CONFIG_NAME, WEIGHT_NAMES
from .rule import FourBit, dequantized, float32_products, four_bit_weights, merged

MERGED = "merged with the adapter"  # the plan's reason for each tensor the adapter changes
COPIED = "4-bit, copied as stored"  # the plan's reason for a 4-bit base's untargeted weights with --quantize


def merge(adapter: str | Path, output_dir: str | Path, *, base: str | Path | None = None, quantize: bool = False,
          options: ConvertOptions | None = None, **changes: Any) -> Summary | Plan:
    """Merge the LoRA adapter `adapter` (a local folder or a Hub repo `org/name[@revision]`) into `base` (default:
    the adapter's `base_model_name_or_path`) and write the result to `output_dir`, one tensor at a time.

    Each targeted weight becomes W + (B @ A) * scaling in float32, rounded once to W's dtype (DoRA, embeddings,
    GPT-2 Conv1D, modules_to_save: docs/merge.md). A 4-bit base (a prequant output) is dequantized as bitsandbytes'
    CUDA kernel does. The output is 16-bit, or 4-bit with `quantize`. Conversion options (device, max_shard_size,
    overwrite, resume, push_to_hub, ...; with a 16-bit base and `quantize`, the 4-bit settings) come as a
    `ConvertOptions` or by keyword. Returns the Summary (the Plan when `dry_run`); interrupted, the same call
    continues; raises PrequantError naming the adapter key, tensor or file for anything it cannot merge, before
    OUTPUT_DIR is claimed. The base's own code (an auto_map in its config.json) runs only with
    `trust_remote_code`."""
    opts = replace(options or ConvertOptions(), **changes)
    started = time.monotonic()
    check_device(opts.device)  # a dry run refuses what the real run would, without starting CUDA
    _check_settings(opts, quantize)
    lora = open_adapter(str(adapter))
    trace.mark("adapter-read")
    base_spec = str(base) if base is not None else lora.base_model
    give_base = spelled("base", "SOURCE")
    if not base_spec:
        raise UsageError(f"the adapter's {CONFIG_NAME} names no base_model_name_or_path; pass the base with "
                         f"{give_base}")
    if not isinstance(base_spec, str):
        raise UsageError(f"'base_model_name_or_path' is {json.dumps(base_spec)[:80]}, not a model's folder or Hub "
                         f"repo id; pass the base with {give_base}", where=lora.directory / CONFIG_NAME)
    out = output.target(output_dir, base_spec, overwrite=opts.overwrite, resume=opts.resume, dry_run=opts.dry_run)
    src, tensors, config, four = _base(base_spec, opts)
    # Which weights are GPT-2 Conv1D (stored [in, out]): a 4-bit base's prequant.json says, else the layout
    # transformers gives the base (a 16-bit base's is needed anyway to quantize it).
    if four:
        four_bit = four_bit_weights(tensors, _check_quant_states(src, tensors))
        decided, conv1d = None, _transposed(src)
        if quantize:
            _check_base_settings(opts, _base_settings(config, four_bit))
    else:
        four_bit = {}
        decided = decide(config, src.path, tensors, list(opts.skip), opts.trust_remote_code)
        conv1d = {k for k, d in decided[0].decisions.items() if d.transpose}
    shapes = {t.name: tuple(t.shape) for t in tensors}  # as merged: a 4-bit weight dequantized, a Conv1D [in, out]
    shapes.update((k, w.shape[::-1] if k in conv1d else w.shape) for k, w in four_bit.items())
    # The meta model `decide` built for a 16-bit base (same dtype) serves the renaming too.
    names = base_names([t.name for t in tensors], src.path, wanted(lora), opts.trust_remote_code,
                       None if four else load_dtype(config, tensors))
    changed = targets(lora, names, shapes, conv1d)
    with TensorReader() as data:  # the adapter's tensors, and a 4-bit base's quant states and block scales
        plan = _plan(tensors, config, changed, four_bit, quantize, opts, decided, conv1d, shapes)
        trace.mark("planned")
        if opts.dry_run:
            return plan
        quantizer = starting.quantizer(plan.settings, opts.device, plan.input_bytes)
        trace.mark("quantizer-started")  # on a GPU, "cuda-ready" follows once it is built
        lora = replace(lora, identity=_identity(lora.identity, lora.directory))  # while CUDA starts, if not ahead
        trace.mark("adapter-hashed")  # the job's fingerprint names the adapter's files by their sha256
        dequantized_too = {k: w for k, w in four_bit.items() if not quantize or k in changed}
        merger = Merger(changed, dequantized_too, conv1d if four else set(), data)
        # A rerun is the same job when the adapter's files are the same, however its path is typed.
        job = Job.planned(src, out, opts, tensors, config, plan, started, adapter={"sha256": lora.identity["sha256"]})

        def write(record: Recorder, staging: Path, stream: Callable) -> None:
            """The base streamed through the merger (float32 products in full precision), then the rest."""
            record.kept = _KeptCheck(opts.allow_nan, set(four_bit) - set(dequantized_too))
            with float32_products(quantizer.device_type):  # CUDA may still be starting
                stream(merger)
            _record(job, record, staging, lora, four, quantize, str(quantizer.device))

        note = f"merged: {len(changed)} tensors changed by the adapter, written {'4-bit' if quantize else '16-bit'}"
        return run_job(job, quantizer, write, stats=opts.stats and quantize,
                       record_options={"skip": list(opts.skip), "max_shard_size": opts.shard_limit,
                                       "quantize": quantize},
                       notes=lambda written: [note])


def _record(job: Job, record: Recorder, staging: Path, lora: Adapter, four: bool, quantize: bool, device: str) -> None:
    """config.json, the card and prequant.json (the adapter, the bases and what changed)."""
    plan, src = job.plan, job.source
    _write_config(staging, job.config, plan, four, quantize)
    identity = source_identity(src)
    card.write(staging, src, identity, lora, plan, quantize, job.options.push_to_hub)
    trace.mark("card-written")  # then the manifest, once the last shards' hashes are done
    files = [*plan.shards, *(p.as_posix() for p in job.side_files), CONFIG, CARD]
    files += [n for n in INDEX_NAMES if (staging / n).is_file()]
    merged = sorted(s.source.name for s in plan.steps if s.decision.reason == MERGED)
    record.write_manifest(staging, files, identity, device, adapter=lora.identity,
                          merge={"base": "4-bit" if four else "16-bit", "output": "4-bit" if quantize else "16-bit",
                                 "targets": merged})


class Merger:
    """The pipeline's transform: each targeted tensor merged (`rule.merged`), a 4-bit base's weights dequantized
    first (`rule.dequantized`; back to their stored [in, out] layout for a GPT-2 Conv1D)."""

    def __init__(self, changed: dict[str, Target], four: dict[str, FourBit], transposed: set[str],
                 data: TensorReader) -> None:
        self.changed, self.four, self.transposed, self.data = changed, four, transposed, data

    def applies(self, step: Step) -> bool:
        return step.source.name in self.changed or step.source.name in self.four

    def __call__(self, step: Step, tensor: Any) -> Any:
        name = step.source.name
        if name in self.four:
            tensor = dequantized(tensor, self.four[name], self.data)
            if name in self.transposed:
                tensor = tensor.T.contiguous()
        target = self.changed.get(name)
        return tensor if target is None else merged(tensor, target, self.data)


class _KeptCheck(KeptCheck):
    """The check of kept tensors, but for a 4-bit base's packed weights copied as stored: codes, not numbers."""

    def __init__(self, allow_nan: bool, packed: set[str]) -> None:
        super().__init__(allow_nan)
        self.packed = packed

    def __call__(self, name: str, tensor: Any) -> tuple[int, int] | None:
        return None if name in self.packed else super().__call__(name, tensor)


def open_adapter(spec: str) -> Adapter:
    """The adapter at `spec`: a local folder, or a Hub repo `org/name[@revision]` (its config and weights
    downloaded into the Hugging Face cache); its identity says where it came from (`_identity` adds its files'
    sha256)."""
    path = Path(spec).expanduser()
    if path.exists():
        if not path.is_dir():
            raise UsageError(f"ADAPTER {spec!r} is a file; pass the folder peft's save_pretrained wrote")
        return read(path, {"spec": spec, "path": str(path)})
    folder.check(spec)  # a mistyped path is refused here, never asked of the Hub
    repo = hub_spec(spec)
    from ..hub import client

    repo_id, revision = client.parse_repo_spec(repo[0])
    commit = client.resolve(repo_id, revision)
    names = [CONFIG_NAME, *[n for n in WEIGHT_NAMES if n in commit.files][:1]]
    local = [client.download(commit, n, large=n != CONFIG_NAME) for n in names if n in commit.files]
    if not local:
        raise PrequantError(f"{repo_id}@{commit.sha[:12]} has no {CONFIG_NAME}; pass the repo of a peft adapter")
    directory = local[0].parent
    ident = {"spec": spec, "repo_id": repo_id, "revision": revision, "commit": commit.sha}
    return read(directory, ident)


def _identity(ident: dict, directory: Path) -> dict:
    """The adapter as the manifest records it: where it came from, and its files' sha256 (hashed ahead by the CLI
    while the libraries loaded, `folder.hash_ahead`, or now)."""
    files = [n for n in (CONFIG_NAME, *WEIGHT_NAMES) if (directory / n).is_file()]
    return {**ident, "sha256": {n: folder.sha256(directory / n) for n in files}}


def _base(spec: str, opts: ConvertOptions) -> tuple[Source, list[TensorRef], dict, bool]:
    """The base, its tensors, its config.json and whether it is a bitsandbytes 4-bit checkpoint (read as it is
    stored; any other is read as a conversion reads its source: FP8 as 16-bit). A 4-bit base on the Hub is
    downloaded first: its quant states, read to plan, give the output's shapes."""
    src = resolve(spec, stream=True, delete=opts.delete_source_shards)
    try:
        config = json.loads((src.path / CONFIG).read_text())
    except (OSError, ValueError) as e:
        raise PrequantError(f"cannot read it ({e}); the base needs its config.json", where=src.path / CONFIG) from e
    qc = config.get("quantization_config") if isinstance(config, dict) else None
    if not (isinstance(qc, dict) and qc.get("quant_method") == "bitsandbytes"):
        held = contents(src)
        return src, held.tensors, held.config, False
    if not qc.get("load_in_4bit"):
        raise PrequantError("the base is bitsandbytes 8-bit; prequant merges into 16-bit, FP8 or 4-bit bases",
                            where=src.path / CONFIG)
    if src.hub is not None:
        src = resolve(spec, delete=opts.delete_source_shards)
    return src, scan(src), config, True


def _check_quant_states(src: Source, tensors: list[TensorRef]) -> dict[str, dict]:
    """A 4-bit base's quant states, by their packed weight's key, checked against their codes and companions by
    verify's own check (which parses them): a state that claims more than its codes hold would dequantize to zeros
    where the codes end."""
    report = Report(str(src.path))
    groups = check_quantized({t.name: t for t in tensors}, {t.name: t.file.name for t in tensors}, report)
    if report.problems:
        first, more = report.problems[0], len(report.problems) - 1
        raise PrequantError(f"{first.message}{f' (and {more} more problems)' if more else ''}; the 4-bit base is "
                            f"damaged ({src.path}): use an intact copy, or merge into its 16-bit original",
                            where=first.where)
    return {weight: g.state for weight, g in groups.items()}


def _transposed(src: Source) -> set[str]:
    """The weights a 4-bit base quantized as their transpose (GPT-2 Conv1D), from its prequant.json."""
    try:
        return set(manifest.load(src.path).get("transposed") or [])
    except PrequantError:
        return set()


_SETTINGS = ("quant_type", "double_quant", "blocksize", "compute_dtype", "quant_storage", "skip")


def _check_settings(opts: ConvertOptions, quantize: bool) -> None:
    """Refuse 4-bit settings given for a 16-bit output (no `quantize`): they would be ignored."""
    if (given := _given(opts)) and not quantize:
        raise UsageError(f"{_said(opts, given[0])} applies to a 4-bit output only; add "
                         f"{flag('quantize')} to write one, or leave it out")


def _check_base_settings(opts: ConvertOptions, base: Settings) -> None:
    """Refuse 4-bit settings that differ from a 4-bit base's own (`base`): its merged weights are quantized again
    with the base's, so the given ones would be ignored."""
    for k in _given(opts):
        if k == "skip" or getattr(base, k) != getattr(opts, k):
            own = "" if k == "skip" else f" ({k} {getattr(base, k)})"
            raise UsageError(f"{_said(opts, k)}: a merge into a 4-bit base quantizes the merged weights again with "
                             f"the base's own settings{own}, and keeps its other modules as they are; leave the option "
                             "out, or merge into the 16-bit base to choose the settings")


def _given(opts: ConvertOptions) -> list[str]:
    """The 4-bit settings given other than their defaults."""
    defaults = ConvertOptions()
    return [k for k in _SETTINGS if getattr(opts, k) != getattr(defaults, k)]


def _said(opts: ConvertOptions, name: str) -> str:
    """A 4-bit setting as its caller wrote it (a flag's negative form for a boolean, one --skip pattern)."""
    value = getattr(opts, name)
    if isinstance(value, bool):
        return flag(name, value)
    if on_command_line() and name == "skip":
        return opts.said(name, value[0])
    return opts.said(name, list(value) if name == "skip" else value)


def _base_settings(config: dict, four: dict[str, FourBit]) -> Settings:
    """The 4-bit settings of a bitsandbytes base: its quantization_config, and its quant states' block size."""
    qc = config["quantization_config"]
    blocksizes = {w.state.get("blocksize") for w in four.values()}
    return Settings(quant_type=qc.get("bnb_4bit_quant_type", "fp4"),
                    double_quant=bool(qc.get("bnb_4bit_use_double_quant")),
                    blocksize=blocksizes.pop() if len(blocksizes) == 1 else 64,
                    compute_dtype=qc.get("bnb_4bit_compute_dtype") or "float32",
                    quant_storage=qc.get("bnb_4bit_quant_storage") or "uint8")


def _plan(tensors: list[TensorRef], config: dict, changed: dict[str, Target], four: dict[str, FourBit],
          quantize: bool, opts: ConvertOptions, decided: tuple[Layout, bool] | None, conv1d: set[str],
          shapes: dict[str, tuple[int, ...]]) -> Plan:
    """Every output: 16-bit (a 4-bit base's weights dequantized), or 4-bit with `quantize` (a 4-bit base's
    targets quantized again with its settings, the rest copied; a 16-bit base planned as `convert` plans it, with
    the layout `decided` for it). `conv1d`: the GPT-2 Conv1D weights; `shapes`: every tensor's as merged."""
    def reason(name: str, default: str) -> str:
        return MERGED if name in changed else default

    def action(name: str, quantized: bool, default: str | None = None) -> str | None:
        return "merge" if name in changed and not quantized else default

    if four:
        s = _base_settings(config, four)
        companions = {ref.name for w in four.values() for ref in w.companions.values()}
        if quantize:  # targets' companions are written anew; everything else copied
            companions = {ref.name for k, w in four.items() if k in changed for ref in w.companions.values()}
        kept = [t for t in tensors if t.name not in companions]
        requant = {t.name for t in kept if quantize and t.name in changed and t.name in four}
        # With --quantize, an untargeted 4-bit weight and its companions are copied as stored: still 4-bit.
        copied = {name for k, w in four.items() if k not in requant
                  for name in (k, *(r.name for r in w.companions.values()))} if quantize else set()

        def decision(t: TensorRef) -> Decision:
            if t.name in copied:
                return Decision(False, COPIED, action="copy")
            default = "dequantized" if t.name in four else "kept"
            verb = "dequantize" if t.name in four and not quantize else None
            return Decision(t.name in requant, reason(t.name, default), transpose=t.name in conv1d,
                            action=action(t.name, t.name in requant, verb))

        decisions = {t.name: decision(t) for t in kept}

        def outputs(t: TensorRef, d: Decision) -> tuple[OutTensor, ...] | None:
            if t.name not in four:
                return None
            w = four[t.name]
            if d.quantize:
                return tuple(OutTensor(e.key, e.dtype, e.shape) for e in settings_entries(t.name, _numel(w), s))
            if quantize:
                return None  # an untargeted 4-bit weight: copied as stored
            return (OutTensor(t.name, w.dtype, shapes[t.name]),)

        plan = make_plan(kept, Layout(decisions, config["quantization_config"].get("llm_int8_skip_modules"),
                                      "merge into the 4-bit base"), s, opts.shard_limit, outputs=outputs,
                         # A packed weight is reported by the parameter it holds, as a 16-bit base's would be
                         shapes={k: shapes[k] for k in four})
        return replace(plan, sixteen_bit=not quantize)
    if quantize:
        assert decided is not None
        layout, settled = decided
        require_known(layout)
        layout = replace(layout, decisions={k: replace(d, reason=reason(k, d.reason), action=action(k, d.quantize))
                                            for k, d in layout.decisions.items()})
        return replace(make_plan(tensors, layout, opts.settings, opts.shard_limit, opts.skip),
                       settled=settled)
    decisions = {t.name: Decision(False, reason(t.name, "kept"), action=action(t.name, False)) for t in tensors}
    return replace(make_plan(tensors, Layout(decisions, None, "merge into the 16-bit base"),
                             opts.settings, opts.shard_limit), sixteen_bit=True)


def _numel(w: FourBit) -> int:
    return math.prod(w.shape)


def _write_config(staging: Path, config: dict, plan: Plan, four: bool, quantize: bool) -> None:
    """config.json: a 16-bit output's without quantization_config; a 4-bit output's with the one it loads with."""
    if not quantize:
        write_json(staging / CONFIG, {k: v for k, v in config.items() if k != "quantization_config"})
    elif four:  # a 4-bit base's, quantized again with its settings
        write_json(staging / CONFIG, config)
    else:
        write_config(staging, config, plan)
