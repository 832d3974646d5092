"""How the `prequant` command's help is laid out: as click lays it out, the same whatever typer is installed."""

from __future__ import annotations

import typer
import typer.core


class Command(typer.core.TyperCommand):
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


def examples(*lines: str) -> str:
    """An epilog of example command lines, kept as written (click rewraps other paragraphs)."""
    return "Examples:\n\n\b\n" + "\n".join(f"  {line}" for line in lines)
