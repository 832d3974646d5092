"""`--help` reads well at 80 columns with whatever typer and click are installed: here and at the floors."""

from __future__ import annotations

import pytest
from helpers import run_cli


COMMANDS = ["convert", "verify", "change-storage", "upload", "version"]


@pytest.mark.parametrize("command", ["", *COMMANDS])
def test_help_reads_well_at_80_columns(command):
    proc = run_cli(*([command] if command else []), "--help", env={"COLUMNS": "80"})
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert all(len(line) <= 80 for line in lines), max(lines, key=len)
    for clutter in ("<bool>", "<str>", "<int>", "<float>", "{", "…", "╭"):
        assert clutter not in proc.stdout, clutter


def test_usage_lines_name_the_arguments():
    assert "prequant convert [OPTIONS] SOURCE OUTPUT_DIR\n" in run_cli("convert", "--help").stdout
    assert "prequant change-storage [OPTIONS] OUTPUT_DIR DEST\n" in run_cli("change-storage", "--help").stdout


def test_arguments_have_their_help():
    text = " ".join(run_cli("convert", "--help", env={"COLUMNS": "80"}).stdout.split())
    assert "SOURCE Local checkpoint directory" in text and "OUTPUT_DIR Where to write the 4-bit checkpoint." in text

