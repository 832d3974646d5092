"""The `prequant` command: thin commands over the library; errors become one line here, once."""

from __future__ import annotations

import json
import os
import sys
from typing import Annotated

from .util import trace  # first, so a trace's "start" is the process' own start (standard library only)

import typer

from .conversion import layout_worker, readahead
from .errors import PrequantError

app = typer.Typer(
    name="prequant",
    help="Pre-quantize large checkpoints to bitsandbytes 4-bit, streaming one tensor at a time.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

# Shared options, defined once.
JsonOpt = Annotated[bool, typer.Option("--json", help="Print the result (or the plan) as JSON on stdout.")]
DeviceOpt = Annotated[
    str, typer.Option("--device", help="auto (a GPU when there is one), cpu, or cuda[:N].", show_default=True)
]


@app.command(
    epilog=(
        "Examples:\n\n"
        "  prequant convert ./Meta-Llama-3-8B ./llama3-8b-nf4\n\n"
        "  prequant convert ./model ./out --dry-run\n\n"
        "  prequant convert grok-1 ./grok-1-nf4 --delete-source-shards   (keyfan/grok-1-hf from the Hub)\n\n"
        "  prequant convert meta-llama/Llama-3.1-8B@main ./llama-nf4\n\n"
        "  prequant convert ./model ./out --quant-type fp4 --no-double-quant --quant-storage uint8 --device cpu"
    )
)
def convert(
    source: Annotated[
        str,
        typer.Argument(help="Local checkpoint directory, Hub repo (org/name or org/name@revision), or alias (grok-1)."),
    ],
    output_dir: Annotated[str, typer.Argument(help="Where to write the 4-bit checkpoint.")],
    quant_type: Annotated[str, typer.Option(help="nf4 or fp4.")] = "nf4",
    double_quant: Annotated[bool, typer.Option("--double-quant/--no-double-quant", help="Quantize the absmax too.")] = True,
    blocksize: Annotated[int, typer.Option(help="Elements per absmax block (64..4096).")] = 64,
    compute_dtype: Annotated[str, typer.Option(help="bnb_4bit_compute_dtype written to the config.")] = "bfloat16",
    quant_storage: Annotated[
        str, typer.Option(help="dtype the packed weights are stored as (bfloat16 for FSDP; uint8, float16, float32).")
    ] = "bfloat16",
    skip: Annotated[
        list[str] | None, typer.Option("--skip", help="Module name or pattern to keep unquantized (repeatable).")
    ] = None,
    max_shard_size: Annotated[str, typer.Option(help="Largest output shard, e.g. 5GB, 500MB, 2GiB.")] = "5GB",
    device: DeviceOpt = "auto",
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the plan and write nothing.")] = False,
    as_json: JsonOpt = False,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace the checkpoint in a non-empty OUTPUT_DIR.")] = False,
    resume: Annotated[
        bool, typer.Option("--resume", help="Continue an interrupted conversion into OUTPUT_DIR (same source and options).")
    ] = False,
    trust_remote_code: Annotated[
        bool, typer.Option("--trust-remote-code", help="Allow running the checkpoint's own model code (meta device only).")
    ] = False,
    stats: Annotated[
        bool, typer.Option("--stats/--no-stats", help="Measure each quantized tensor's error against the source (prequant.json).")
    ] = True,
    push_to_hub: Annotated[
        str | None,
        typer.Option("--push-to-hub", metavar="REPO_ID", help="Then verify and upload to this Hub repo (org/name[@branch])."),
    ] = None,
    delete_source_shards: Annotated[
        bool,
        typer.Option("--delete-source-shards", help="Hub source: delete each shard prequant downloaded from the Hugging "
                     "Face cache once converted (disk holds about two source shards plus the output)."),
    ] = False,
) -> None:
    """Convert SOURCE into a bitsandbytes 4-bit checkpoint in OUTPUT_DIR."""
    arguments = dict(locals())
    if layout_worker.worthwhile():
        layout_worker.start(source, skip or [], trust_remote_code)  # transformers imports there, torch here
    if not (dry_run or resume):
        readahead.start_for_source(source)  # the disk works while torch imports
    from .conversion.options import ConvertOptions
    from .conversion.run import convert as run_convert

    trace.mark("imported")
    result = run_convert(source, output_dir, ConvertOptions.pick(arguments))
    print(json.dumps(result.to_dict(), indent=2) if as_json else result.to_text())


@app.command(
    epilog=(
        "Exit status: 0 when every check passes, 1 when one fails (the first problem on stderr, the full report "
        "on stdout), 2 for usage errors.\n\n"
        "Examples:\n\n"
        "  prequant verify ./llama3-8b-nf4\n\n"
        "  prequant verify ./llama3-8b-nf4 --source ./Meta-Llama-3-8B --json"
    )
)
def verify(
    output_dir: Annotated[str, typer.Argument(help="A folder written by prequant convert.")],
    source: Annotated[
        str | None, typer.Option("--source", help="The original checkpoint: also measure each tensor's error against it.")
    ] = None,
    max_rel_error: Annotated[
        float | None,
        typer.Option("--max-rel-error", help="With --source, fail tensors above this relative error (default: 4x the "
                     "Gaussian figure for the settings, e.g. 0.368 for NF4 block 64)."),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Check OUTPUT_DIR: files against prequant.json (size, sha256), index against shards, quant states, config."""
    from .verify.report import VerificationFailed
    from .verify.run import verify as run_verify

    report = run_verify(output_dir, source, max_rel_error=max_rel_error)
    print(json.dumps(report.to_dict(), indent=2) if as_json else report.to_text())
    if not report.ok:
        raise VerificationFailed(report)


@app.command(
    epilog=(
        "The token comes from HF_TOKEN or `hf auth login`. Nothing is sent unless OUTPUT_DIR verifies.\n\n"
        "Examples:\n\n"
        "  prequant upload ./llama3-8b-nf4 my-org/llama3-8b-bnb-nf4\n\n"
        "  prequant upload ./llama3-8b-nf4 my-org/llama3-8b-bnb --revision nf4 --private --json"
    )
)
def upload(
    output_dir: Annotated[str, typer.Argument(help="A folder written by prequant convert.")],
    repo_id: Annotated[str, typer.Argument(help="Hub model repo, org/name (created if missing).")],
    revision: Annotated[str | None, typer.Option("--revision", help="Branch to commit to (created from main).")] = None,
    private: Annotated[bool, typer.Option("--private", help="Create the repo as private.")] = False,
    commit_message: Annotated[str | None, typer.Option("--commit-message", help="Message of the Hub commit.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Verify OUTPUT_DIR, then upload it to a Hub model repo in one commit (refused if it does not verify)."""
    from .verify.publish import upload as run_upload

    result = run_upload(output_dir, repo_id, revision=revision, private=private, commit_message=commit_message)
    if as_json:
        print(json.dumps(result, indent=2))
    else:
        print(f"uploaded {len(result['files'])} files ({result['bytes'] / 1e9:.3f} GB) to {result['commit_url']}")


@app.command(
    "check-fsdp",
    epilog=(
        "Runs `python -m torch.distributed.run --nproc_per_node N -m prequant.fsdp.job` once per loader "
        "(its output on stderr). Exit status: 0 when every check passes, 1 when one fails, 2 for usage errors.\n\n"
        "Examples:\n\n"
        "  prequant check-fsdp ./llama3-8b-nf4 --nproc 2\n\n"
        "  prequant check-fsdp ./llama3-8b-nf4 --nproc 2 --loader prequant --steps 20 --report check.json\n\n"
        "  prequant check-fsdp ./llama3-8b-nf4 --nproc 2 --loader prequant --loader trainer"
    ),
)
def check_fsdp(
    output_dir: Annotated[str, typer.Argument(help="A folder written by prequant convert.")],
    nproc: Annotated[int, typer.Option("--nproc", help="Ranks to run (one GPU each; gloo on CPU without CUDA).")] = 2,
    loader: Annotated[
        list[str] | None,
        typer.Option("--loader", help="transformers (HF's FSDP-QLoRA path), prequant (load_for_fsdp) or trainer "
                     "(load_for_fsdp trained by TRL's SFTTrainer); repeatable; default: transformers and prequant. "
                     "The first-step losses of all loaders run are compared."),
    ] = None,
    steps: Annotated[int, typer.Option(help="Training steps on the fixed batch.")] = 10,
    seed: Annotated[int, typer.Option(help="Seed of the batch and of the LoRA init.")] = 0,
    batch_size: Annotated[int, typer.Option(help="Sequences in the batch.")] = 2,
    seq_len: Annotated[int, typer.Option(help="Tokens per sequence.")] = 256,
    lora_r: Annotated[int, typer.Option(help="LoRA rank.")] = 16,
    buffer_dtype: Annotated[
        str, typer.Option(help="Floating buffers (RoPE) in bfloat16 as HF's Trainer casts them, float32, or keep.")
    ] = "bfloat16",
    packed_storage: Annotated[
        str, typer.Option(help="prequant loader: uint8 (safe) or checkpoint (bf16 as stored; bitsandbytes #1945).")
    ] = "uint8",
    timeout: Annotated[float, typer.Option(help="Seconds allowed per loader run.")] = 1800,
    report: Annotated[str | None, typer.Option("--report", metavar="FILE", help="Also write the JSON report here.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Train a few FSDP+QLoRA steps from OUTPUT_DIR on N ranks: memory per rank, losses, packed bytes intact."""
    from .fsdp.check import CheckFailed, CheckOptions
    from .fsdp.check import check_fsdp as run_check

    options = CheckOptions.pick({**locals(), "loaders": loader})
    result = run_check(output_dir, options)
    text = json.dumps(result.to_dict(), indent=2)
    if report:
        with open(report, "w") as f:
            f.write(text)
    print(text if as_json else result.to_text())
    if not result.ok:
        raise CheckFailed(result)


@app.command()
def version() -> None:
    """Print prequant's version."""
    from ._version import __version__

    print(__version__)


def run() -> None:
    """The `prequant` command (console script and `python -m prequant`): `main()`, then leave at once.

    Once a command has finished, stdout and stderr are flushed and atexit handlers (the trace, logging)
    have run, nothing is left to do; the interpreter's own teardown would still spend about two seconds
    destroying torch's and CUDA's state (measured on the GPU machine), so the process exits without it.
    An unexpected exception still takes the normal path, traceback and all."""
    try:
        main()
        code = 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more can be said there anyway
            pass
    os._exit(code)


def main() -> None:
    """Run the app; PrequantError becomes `Error: ...` on stderr with its exit code."""
    try:
        app(standalone_mode=False)
    except PrequantError as e:
        if os.environ.get("PREQUANT_DEBUG"):
            raise
        # One line whatever the message holds: names taken from a corrupt file may contain newlines.
        print("Error: " + " ".join(e.message.splitlines()), file=sys.stderr)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        print("Error: interrupted", file=sys.stderr)
        sys.exit(130)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except Exception as e:  # click usage errors and the like
        # typer raises the click it runs on: the click package, or (typer >= 0.2x) its own vendored copy.
        click_exceptions = sys.modules[typer.BadParameter.__module__]
        if isinstance(e, click_exceptions.ClickException):
            e.show()
            sys.exit(e.exit_code)
        if isinstance(e, click_exceptions.Abort):
            sys.exit(1)
        raise
