"""The package as a user meets it: quiet setup (no warning from our own packaging), quiet loads (bitsandbytes'
CPU-kernel line dropped where prequant is imported), and the demo folder README makes kept out of git."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
from helpers import ROOT, cli_env

# What bitsandbytes' CPU backend logs, at its import on a CPU with AVX512-BF16, when it cannot fetch its optional
# inference kernel from the Hub (bitsandbytes/backends/cpu/ops.py, the same format and logger).
KERNEL_NOTE = ("Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please make sure you already `pip "
               "install kernels` and the kernels >= 0.11.1")


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=cli_env(), check=True)


def test_bitsandbytes_cpu_kernel_line_is_dropped_and_its_other_messages_pass():
    proc = _python(
        "import logging, prequant\n"
        "log = logging.getLogger('bitsandbytes.backends.cpu.ops')\n"
        f"log.warning({KERNEL_NOTE!r}, 'Cannot reach the Hub')\n"
        "log.warning('another bitsandbytes warning')\n"
    )
    assert "gemm_4bit_forward" not in proc.stderr and "another bitsandbytes warning" in proc.stderr, proc.stderr


def test_importing_bitsandbytes_after_prequant_prints_no_kernel_line():
    """On a CPU with AVX512-BF16 (most GPU hosts) bitsandbytes' own import logs the line; elsewhere it never does,
    and this passes either way."""
    proc = _python("import prequant, bitsandbytes")
    assert "gemm_4bit_forward" not in proc.stderr, proc.stderr


def test_packaging_raises_no_deprecation_warning():
    """pyproject's licence is an SPDX expression, not the table setuptools deprecates (warned at every install)."""
    pytest.importorskip("setuptools")
    proc = subprocess.run(
        [sys.executable, "-W", "error", "-c",
         "from setuptools.config.pyprojecttoml import apply_configuration\n"
         "from setuptools.dist import Distribution\n"
         "print(apply_configuration(Distribution(), 'pyproject.toml').metadata.license_expression)"],
        cwd=ROOT, capture_output=True, text=True, check=False,
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "Apache-2.0", proc.stderr


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs a git checkout")
def test_the_readme_demo_folder_is_ignored_by_git():
    proc = subprocess.run(["git", "check-ignore", "-q", "demo/tiny-llama/config.json"], cwd=ROOT, check=False)
    assert proc.returncode == 0
