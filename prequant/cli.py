"""The `prequant` command: thin commands over the library; errors become one line here, once."""

from __future__ import annotations

import json
import signal
import sys
from typing import Annotated

from .util import signals, trace  # first, so a trace's "start" is the process' own start (standard library only)

import typer
import typer.core

from . import settings
from .bnb.format import choice  # standard library only
from .errors import PrequantError, command_line


class _Command(typer.core.TyperCommand):
    """Help laid out as click lays it out, with each argument by its metavar: recent typers write required
    arguments as `{name}` and add a `<type>` column, older ones do neither; this reads the same on all of them."""

    def collect_usage_pieces(self, ctx: object) -> list[str]:
        return ["[OPTIONS]", *(p.metavar or p.name.upper() for p in self.params if p.param_type_name == "argument")]

    def format_options(self, ctx: object, formatter: object) -> None:
        arguments = [(p.metavar or p.name.upper(), p.help or "") for p in self.params
                     if p.param_type_name == "argument"]
        options = [r for p in self.get_params(ctx) if p.param_type_name == "option" and (r := p.get_help_record(ctx))]
        for title, rows in (("Arguments", arguments), ("Options", options)):
            if rows:
                with formatter.section(title):
                    formatter.write_dl(rows)


def _examples(*lines: str) -> str:
    """An epilog of example command lines, kept as written (click rewraps other paragraphs)."""
    return "Examples:\n\n\b\n" + "\n".join(f"  {line}" for line in lines)


app = typer.Typer(
    name="prequant",
    help="Pre-quantize large checkpoints to bitsandbytes 4-bit, streaming one tensor at a time.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # Plain help, as click lays it out: it reads the same at 80 columns whatever typer and rich are installed
    # (rich's panels squeeze descriptions into a narrow last column and cut long option names).
    rich_markup_mode=None,
)


OutputArg = Annotated[str, typer.Argument(metavar="OUTPUT_DIR", help="A folder written by prequant convert.")]
DeviceOpt = Annotated[str, typer.Option("--device", metavar="DEVICE", help="auto (a GPU when there is one, for "
                                        "weights of 256 MiB or more: below, CUDA's start-up costs more than the CPU "
                                        "takes; same bytes), cpu, or cuda[:N].")]


def _choice(name: str) -> object:
    """An option's callback: a value `choice` refuses is refused as the library refuses it, but while the command
    line is read, before torch's import."""
    def check(value: object) -> object:
        return value if value is None else choice(name, value)

    return check


# The 4-bit settings, shared by convert and merge --quantize (where a 4-bit base's own settings apply instead).
QuantTypeOpt = Annotated[str, typer.Option("--quant-type", metavar="nf4|fp4", help="4-bit data type (any case).",
                                           callback=_choice("quant_type"))]
DoubleQuantOpt = Annotated[bool, typer.Option("--double-quant/--no-double-quant", help="Quantize the absmax too.")]
BlocksizeOpt = Annotated[int, typer.Option("--blocksize", metavar="N", help="Elements per absmax block (64..4096).",
                                           callback=_choice("blocksize"))]
ComputeDtypeOpt = Annotated[str, typer.Option("--compute-dtype", metavar="DTYPE",
                                              help="bnb_4bit_compute_dtype written to the config.",
                                              callback=_choice("compute_dtype"))]
QuantStorageOpt = Annotated[str, typer.Option("--quant-storage", metavar="DTYPE", help="dtype the packed weights are "
                            "stored as: bfloat16 for FSDP (your training dtype), uint8 for vLLM/SGLang, float16, "
                            "float32.", callback=_choice("quant_storage"))]
SkipOpt = Annotated[list[str] | None, typer.Option(
    "--skip", metavar="PATTERN", help="Module name or pattern to keep unquantized (repeatable).")]
StatsOpt = Annotated[bool, typer.Option(
    "--stats/--no-stats", help="Measure each quantized tensor's error against the source (prequant.json).")]
MaxShardSizeOpt = Annotated[str, typer.Option(
    "--max-shard-size", metavar="SIZE", help="Largest output shard, e.g. 5GB, 500MB, 2GiB.")]
DryRunOpt = Annotated[bool, typer.Option("--dry-run", help="Print the plan and write nothing.")]
TrustRemoteCodeOpt = Annotated[bool, typer.Option("--trust-remote-code", help="Allow running the checkpoint's own "
                                                  "model code (merge: the base's; meta device only).")]
PrivateOpt = Annotated[bool, typer.Option("--private", help="With --push-to-hub: create the repo as private (an "
                                          "existing public repo is refused).")]


@app.command(
    cls=_Command,
    short_help='Convert a checkpoint to bitsandbytes 4-bit.',
    epilog=_examples(
        "prequant convert ./Meta-Llama-3-8B ./llama3-8b-nf4",
        "prequant convert ./model ./out --dry-run",
        "prequant convert grok-1 ./grok-1-nf4 --delete-source-shards",
        "    (grok-1: keyfan/grok-1-hf from the Hub)",
        "prequant convert meta-llama/Llama-3.1-8B@main ./llama-nf4",
        "prequant convert ./model ./out --quant-type fp4 --no-double-quant \\",
        "    --quant-storage uint8 --device cpu",
    )
)
def convert(
    source: Annotated[str, typer.Argument(metavar="SOURCE", help="Local checkpoint directory, Hub repo (org/name or "
                       "org/name@revision), or alias (grok-1)."),
    ],
    output_dir: Annotated[str, typer.Argument(metavar="OUTPUT_DIR", help="Where to write the 4-bit checkpoint.")],
    quant_type: QuantTypeOpt = "nf4",
    double_quant: DoubleQuantOpt = True,
    blocksize: BlocksizeOpt = 64,
    compute_dtype: ComputeDtypeOpt = "bfloat16",
    quant_storage: QuantStorageOpt = "bfloat16",
    quantize_experts: Annotated[bool, typer.Option("--quantize-experts", help="Quantize MoE experts too (transformers "
        "5 keeps them): each 4-bit under its own name; load with transformers 4.57 or prequant.load_model.")] = False,
    skip: SkipOpt = None,
    max_shard_size: MaxShardSizeOpt = "5GB",
    device: DeviceOpt = "auto",
    dry_run: DryRunOpt = False,
    as_json: Annotated[bool, typer.Option(
        "--json", help="Print the summary (with --dry-run, the plan) as JSON on stdout.")] = False,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace what a non-empty OUTPUT_DIR holds (another "
                         "checkpoint, another conversion's interrupted work); this same conversion is continued.")
                         ] = False,
    resume: Annotated[bool, typer.Option(
        "--resume", help="Continue an interrupted conversion into OUTPUT_DIR, or fail if there is none to continue "
        "(the same command continues one without it too).")] = False,
    trust_remote_code: TrustRemoteCodeOpt = False,
    stats: StatsOpt = True,
    base_model: Annotated[
        str | None,
        typer.Option("--base-model", metavar="REPO_ID", help="The card's base_model, for a local SOURCE (a Hub "
                     "SOURCE names its own repo)."),
    ] = None,
    push_to_hub: Annotated[
        str | None,
        typer.Option("--push-to-hub", metavar="REPO_ID", help="Upload to this Hub repo (org/name[@branch]): each shard "
                     "once written, all in one commit once the output verifies; run again, it continues."),
    ] = None,
    private: PrivateOpt = False,
    delete_source_shards: Annotated[
        bool,
        typer.Option("--delete-source-shards", help="Hub source: delete each shard prequant downloaded from the Hugging "
                     "Face cache once converted (disk holds about two source shards plus the output)."),
    ] = False,
    allow_nan: Annotated[
        bool,
        typer.Option("--allow-nan", help="Copy kept (unquantized) tensors holding NaN as they are instead of refusing "
                     "(recorded in prequant.json)."),
    ] = False,
) -> None:
    """Convert SOURCE into a bitsandbytes 4-bit checkpoint in OUTPUT_DIR (run again, it continues where it stopped)."""
    arguments = dict(locals())
    from .conversion import output, readahead  # standard library, like source.spec: all run before torch's import
    from .source.spec import where

    # before anything slow
    output.target(output_dir, source, overwrite=overwrite, resume=resume, dry_run=dry_run)
    where(source)  # a SOURCE that is neither a local directory nor a Hub repo id fails here, before torch's import
    if not dry_run:
        readahead.prefetch(source)  # a local source's disk reads go on while the libraries load
    with signals.deferred():  # torch's imports; a signal there stops the command here, before any output
        from .conversion.options import ConvertOptions
        from .conversion.run import convert as run_convert
    trace.mark("imported")
    result = run_convert(source, output_dir, ConvertOptions.pick(arguments))
    print(json.dumps(result.to_dict(), indent=2) if as_json else result.to_text())


@app.command(
    cls=_Command,
    short_help='Check a converted checkpoint (and its error).',
    epilog="Exit status: 0 when every check passes, 1 when one fails (the first problem on stderr, the full report "
    "on stdout), 2 for usage errors.\n\n"
    + _examples("prequant verify ./llama3-8b-nf4", "prequant verify ./llama3-8b-nf4 --source ./Meta-Llama-3-8B --json")
)
def verify(
    output_dir: OutputArg,
    source: Annotated[
        str | None,
        typer.Option("--source", metavar="SOURCE", help="The original checkpoint: also measure each tensor's error "
                     "against it."),
    ] = None,
    max_rel_error: Annotated[
        float | None,
        typer.Option("--max-rel-error", metavar="X", help="With --source: fail tensors above this relative error, a "
                     "number above 0 (default: 4x the Gaussian figure for the settings, e.g. 0.368 for NF4 block 64)."),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON on stdout.")] = False,
) -> None:
    """Check OUTPUT_DIR: files against prequant.json (size, sha256), index against shards, quant states, config."""
    with signals.deferred():  # torch's imports (see convert)
        from .verify.check import VerificationFailed
        from .verify.run import check_arguments, verify as run_verify

    check_arguments(source, max_rel_error)
    report = run_verify(output_dir, source, max_rel_error=max_rel_error)
    print(json.dumps(report.to_dict(), indent=2) if as_json else report.to_text())
    if not report.ok:
        raise VerificationFailed(report)


@app.command(
    "change-storage",
    cls=_Command,
    short_help='Copy a checkpoint with another quant storage.',
    epilog="The packed 4-bit bytes are the same whatever the storage: bfloat16 (or your training dtype) for "
    "FSDP+QLoRA, uint8 for vLLM and SGLang. OUTPUT_DIR is verified first and left as it is; DEST (a new or empty "
    "folder) gets what convert --quant-storage DTYPE would have written.\n\n"
    + _examples("prequant change-storage ./llama3-8b-nf4 ./llama3-8b-nf4-vllm \\", "    --quant-storage uint8")
)
def change_storage(
    output_dir: OutputArg,
    dest: Annotated[str, typer.Argument(metavar="DEST", help="Where to write the copy: a new or empty folder (a "
                                        "non-empty one with --overwrite).")],
    quant_storage: Annotated[
        str, typer.Option("--quant-storage", metavar="DTYPE", help="The new storage: uint8, bfloat16, float16 or "
                          "float32.")
    ],
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace the checkpoint in a non-empty DEST.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON on stdout.")] = False,
) -> None:
    """Copy OUTPUT_DIR to DEST with its packed weights stored as another dtype (headers, config, card rewritten)."""
    with signals.deferred():  # torch's imports (see convert)
        from .conversion.storage import change_storage as run_change

    result = run_change(output_dir, dest, quant_storage, overwrite=overwrite)
    print(json.dumps(result.to_dict(), indent=2) if as_json else result.to_text())


@app.command(
    cls=_Command,
    short_help='Merge a LoRA adapter into its base, streaming.',
    epilog="The base is a 16-bit or FP8 checkpoint or a prequant 4-bit output. Each targeted weight becomes "
    "W + (B @ A) * scaling in float32, rounded once (docs/merge.md); run again, it continues where it stopped.\n\n"
    + _examples("prequant merge ./my-adapter ./llama3-8b-merged",
                "prequant merge my-org/llama3-8b-lora ./merged --base ./llama3-8b-nf4",
                "prequant merge ./my-adapter ./merged-nf4 --base ./llama3-8b-nf4 --quantize",
                "prequant merge ./my-adapter ./merged-fp4 --base ./Meta-Llama-3-8B --quantize \\",
                "    --quant-type fp4 --no-stats")
)
def merge(
    adapter: Annotated[str, typer.Argument(metavar="ADAPTER", help="A peft LoRA adapter: local folder or Hub repo "
                                           "(org/name[@revision]).")],
    output_dir: Annotated[str, typer.Argument(metavar="OUTPUT_DIR", help="Where to write the merged checkpoint.")],
    base: Annotated[str | None, typer.Option("--base", metavar="SOURCE", help="The base: local checkpoint, Hub repo "
                    "or prequant 4-bit output (default: the adapter's base_model_name_or_path).")] = None,
    quantize: Annotated[bool, typer.Option("--quantize", help="Write 4-bit: a 4-bit base's own settings, else the "
                        "options below (default: 16-bit).")] = False,
    quant_type: QuantTypeOpt = "nf4",
    double_quant: DoubleQuantOpt = True,
    blocksize: BlocksizeOpt = 64,
    compute_dtype: ComputeDtypeOpt = "bfloat16",
    quant_storage: QuantStorageOpt = "bfloat16",
    skip: SkipOpt = None,
    stats: StatsOpt = True,
    max_shard_size: MaxShardSizeOpt = "5GB",
    device: DeviceOpt = "auto",
    dry_run: DryRunOpt = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the summary as JSON on stdout.")] = False,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace what a non-empty OUTPUT_DIR holds.")] = False,
    resume: Annotated[bool, typer.Option("--resume", help="Continue an interrupted merge, or fail if there is none.")
                      ] = False,
    push_to_hub: Annotated[str | None, typer.Option("--push-to-hub", metavar="REPO_ID", help="Then verify and upload "
                           "to this Hub repo (org/name[@branch]).")] = None,
    private: PrivateOpt = False,
    trust_remote_code: TrustRemoteCodeOpt = False,
) -> None:
    """Merge the LoRA adapter ADAPTER into its base and write the result to OUTPUT_DIR, one tensor at a time."""
    arguments = dict(locals())
    from .conversion import readahead  # standard library, like merging.folder: both run before torch's import
    from .merging import folder
    from .source.spec import where

    folder.check(adapter)  # a mistyped ADAPTER path fails here, before torch's import
    if base is not None:
        where(base)  # and a mistyped --base
    if not dry_run:
        weights, named_base = folder.peek(adapter)
        readahead.prefetch(base or named_base, first=weights)  # a local adapter and base, while the libraries load
        folder.hash_ahead(adapter)  # and the adapter's sha256, which the job's fingerprint names it by
    with signals.deferred():  # torch's imports (see convert)
        from .conversion.options import ConvertOptions
        from .merging.run import merge as run_merge
    trace.mark("imported")
    result = run_merge(adapter, output_dir, base=base, quantize=quantize, options=ConvertOptions.pick(arguments))
    print(json.dumps(result.to_dict(), indent=2) if as_json else result.to_text())


@app.command(
    cls=_Command,
    short_help='Verify, then upload to the Hugging Face Hub.',
    epilog="The token comes from HF_TOKEN or `hf auth login`. Nothing is sent unless OUTPUT_DIR verifies.\n\n"
    + _examples("prequant upload ./llama3-8b-nf4 my-org/llama3-8b-bnb-nf4",
                "prequant upload ./llama3-8b-nf4 my-org/llama3-8b-bnb --revision nf4 \\",
                "    --private --json")
)
def upload(
    output_dir: OutputArg,
    repo_id: Annotated[str, typer.Argument(metavar="REPO_ID", help="Hub model repo, org/name (created if missing).")],
    revision: Annotated[str | None, typer.Option(
        "--revision", metavar="BRANCH", help="Branch to commit to (created from main).")] = None,
    private: Annotated[bool, typer.Option("--private", help="Create the repo as private.")] = False,
    commit_message: Annotated[str | None, typer.Option(
        "--commit-message", metavar="MSG", help="Message of the Hub commit.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print what was uploaded as JSON on stdout.")] = False,
) -> None:
    """Verify OUTPUT_DIR, then upload it to a Hub model repo in one commit (refused if it does not verify)."""
    with signals.deferred():  # torch's imports (see convert)
        from .verify.publish import upload as run_upload

    result = run_upload(output_dir, repo_id, revision=revision, private=private, commit_message=commit_message)
    if as_json:
        print(json.dumps(result, indent=2))
    else:
        print(f"uploaded {len(result['files'])} files ({result['bytes'] / 1e9:.3f} GB) to {result['commit_url']}")


def _print_version(value: bool) -> None:
    if value:
        from ._version import __version__

        print(__version__)
        raise typer.Exit()


@app.callback()
def _options(
    version: Annotated[
        bool, typer.Option("--version", callback=_print_version, is_eager=True, help="Print prequant's version and exit.")
    ] = False,
) -> None:
    # The options of `prequant` itself, before the command (no docstring: the app's help stays its own).
    pass


@app.command()
def version() -> None:
    """Print prequant's version."""
    from ._version import __version__

    print(__version__)


def main() -> None:
    """Run the app: how it ended becomes one line on stderr and an honest exit status. 0 for success, 1 for
    failures, 2 for usage errors, 130 / 143 for SIGINT / SIGTERM; a PrequantError prints its own message, anything
    unexpected its type and message (PREQUANT_DEBUG=1: the traceback instead)."""
    try:
        with command_line():
            code = app(standalone_mode=False)
    except PrequantError as e:
        if settings.debug():
            raise
        print("Error: " + _one_line(e.message), file=sys.stderr)  # names from a corrupt file may hold newlines
        sys.exit(e.exit_code)
    except KeyboardInterrupt as e:
        sys.exit(interrupted(signals.of(e)))
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except typer.Abort:
        sys.exit(1)
    except Exception as e:
        # typer raises the click it runs on: the click package, or (typer >= 0.2x) its own vendored copy.
        click_exceptions = sys.modules[typer.BadParameter.__module__]
        if isinstance(e, click_exceptions.ClickException):  # usage errors and the like
            e.show()
            sys.exit(e.exit_code)
        if settings.debug():
            raise
        what = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        print(f"Error: {_one_line(what)} (PREQUANT_DEBUG=1 shows the traceback)", file=sys.stderr)
        sys.exit(1)
    if code == 130:  # typer turns a KeyboardInterrupt inside a command into this exit code, and returns it
        sys.exit(interrupted(signals.received() or signal.SIGINT))
    if isinstance(code, int) and code:
        sys.exit(code)


def interrupted(signum: int) -> int:
    """Say that a signal stopped the command; return its exit status."""
    print(f"Error: interrupted by {signals.name(signum)}", file=sys.stderr)
    return signals.exit_code(signum)


def _one_line(text: str, limit: int = 1000) -> str:
    line = " ".join(text.splitlines())
    return line if len(line) <= limit else line[: limit - 3] + "..."
