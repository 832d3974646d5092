"""The declared version ranges: every dependency has a floor, and the floor environment is at exactly those floors."""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata

import pytest
from helpers import ROOT

sys.path.insert(0, str(ROOT / "scripts" / "dev"))
import floors  # noqa: E402


def test_every_runtime_dependency_declares_the_version_tested():
    pins = floors.floors(floors.requirements())
    assert {"torch", "transformers", "bitsandbytes", "huggingface-hub", "safetensors", "accelerate", "peft", "typer",
            "tqdm"} <= set(pins)
    assert floors._key(pins["transformers"]) >= (5,)  # transformers 4.x requires huggingface_hub < 1.0
    assert floors._key(pins["bitsandbytes"]) >= (0, 46, 1)  # transformers 5 refuses anything older


def test_a_dependency_without_a_floor_is_refused():
    with pytest.raises(SystemExit, match="no lower bound"):
        floors.floors(["torch"])


def test_script_prints_pip_constraints():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "dev" / "floors.py")], capture_output=True, text=True,
                         check=True).stdout
    pins = dict(line.split("==") for line in out.splitlines() if line and not line.startswith("#"))
    assert pins["torch"] == floors.CPU_TORCH and pins["transformers"] == "5.0"


@pytest.mark.skipif(not sys.prefix.endswith(".venv-floor"), reason="checks the floor environment (.ci/run's second)")
def test_floor_environment_is_at_the_floors():
    from packaging.version import Version

    expected = dict(line.split("==") for line in (ROOT / ".venv-floor" / "floors.txt").read_text().splitlines()
                    if line and not line.startswith("#"))
    installed = {name: Version(Version(metadata.version(name)).public) for name in expected}  # 2.13.0+cpu: 2.13.0
    assert installed == {name: Version(v) for name, v in expected.items()}
