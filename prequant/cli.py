"""The `prequant` command: thin commands over the library; errors become one line here, once."""

from __future__ import annotations

import json
import os
import sys
from typing import Annotated

import typer

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
        "  prequant convert ./model ./out --quant-type fp4 --no-double-quant --quant-storage uint8 --device cpu"
    )
)
def convert(
    source: Annotated[str, typer.Argument(help="Local checkpoint directory.")],
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
    trust_remote_code: Annotated[
        bool, typer.Option("--trust-remote-code", help="Allow running the checkpoint's own model code (meta device only).")
    ] = False,
) -> None:
    """Convert SOURCE into a bitsandbytes 4-bit checkpoint in OUTPUT_DIR."""
    from .convert import convert as run_convert

    result = run_convert(
        source,
        output_dir,
        quant_type=quant_type,
        double_quant=double_quant,
        blocksize=blocksize,
        compute_dtype=compute_dtype,
        quant_storage=quant_storage,
        skip=skip or [],
        max_shard_size=max_shard_size,
        device=device,
        dry_run=dry_run,
        overwrite=overwrite,
        trust_remote_code=trust_remote_code,
    )
    print(json.dumps(result.to_dict(), indent=2) if as_json else result.to_text())


@app.command()
def version() -> None:
    """Print prequant's version."""
    from . import __version__

    print(__version__)


def main() -> None:
    """Entry point: run the app; PrequantError becomes `Error: ...` on stderr with its exit code."""
    try:
        app(standalone_mode=False)
    except PrequantError as e:
        if os.environ.get("PREQUANT_DEBUG"):
            raise
        print(f"Error: {e.message}", file=sys.stderr)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        print("Error: interrupted", file=sys.stderr)
        sys.exit(130)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except Exception as e:  # click usage errors and the like
        import click

        if isinstance(e, click.exceptions.ClickException):
            e.show()
            sys.exit(e.exit_code)
        if isinstance(e, click.exceptions.Abort):
            sys.exit(1)
        raise
