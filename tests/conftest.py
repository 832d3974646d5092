"""The test session: its environment (offline, a Hugging Face cache of its own) and the shared fixtures; helpers
live in helpers.py."""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hub_server import HubServer, hub_server  # noqa: F401 - the local Hub fixture, for every test module
from helpers import (  # noqa: E402 - after the path above
    ROOT,
    build_checkpoint, ORIGINAL_CARD,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Never the user's Hugging Face cache: a directory of this session's own (tests that talk to the local Hub
# server get a fresh one each, from the hub_server fixture).
os.environ["HF_HOME"] = tempfile.mkdtemp(prefix="prequant-tests-hf-")
atexit.register(shutil.rmtree, os.environ["HF_HOME"], ignore_errors=True)
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """Build each tiny checkpoint once per session: `checkpoints(kind)` -> its directory."""
    made: dict[tuple, Path] = {}

    def get(kind: str, max_shard_size: str | None = None) -> Path:
        key = (kind, max_shard_size)
        if key not in made:
            made[key] = build_checkpoint(kind, tmp_path_factory.mktemp(f"{kind}-src"), max_shard_size=max_shard_size)
        return made[key]

    return get


@pytest.fixture(scope="session")
def converted_llama(checkpoints, tmp_path_factory) -> tuple[Path, Path]:
    """(source, output): a tiny Llama converted into two shards, once per session. Shared: read it, never
    modify it (copy it first, e.g. with shutil.copytree, to damage or edit it)."""
    import prequant

    src = checkpoints("llama")
    out = tmp_path_factory.mktemp("llama-converted") / "out"
    prequant.convert(src, out, device="cpu", progress=False, max_shard_size="100KB")
    return src, out


@pytest.fixture(scope="session")
def converted_gpt2(checkpoints, tmp_path_factory) -> tuple[Path, Path]:
    """(source, output): a tiny GPT-2 (Conv1D weights, quantized transposed) converted, once per session.
    Shared: read it, never modify it."""
    import prequant

    src = checkpoints("gpt2")
    out = tmp_path_factory.mktemp("gpt2-converted") / "out"
    prequant.convert(src, out, device="cpu", progress=False)
    return src, out


@pytest.fixture(scope="session")
def carded_source(checkpoints, tmp_path_factory) -> Path:
    """A tiny Llama whose folder also holds a model card with licence metadata."""
    src = tmp_path_factory.mktemp("carded") / "tiny-llama"
    shutil.copytree(checkpoints("llama"), src)
    (src / "README.md").write_text(ORIGINAL_CARD)
    return src


@pytest.fixture(scope="session")
def carded_converted(carded_source, tmp_path_factory) -> Path:
    """carded_source converted (shared: copy it before changing anything)."""
    import prequant

    out = tmp_path_factory.mktemp("upload") / "tiny-llama-nf4"
    prequant.convert(carded_source, out, device="cpu", progress=False)
    return out


@pytest.fixture
def advice(monkeypatch) -> list[tuple[int, int, int]]:
    """Every posix_fadvise call as (offset, length, advice), the real call still made."""
    calls: list[tuple[int, int, int]] = []
    real = os.posix_fadvise

    def record(fd: int, offset: int, length: int, how: int) -> None:
        calls.append((offset, length, how))
        real(fd, offset, length, how)

    monkeypatch.setattr(os, "posix_fadvise", record)
    return calls


@pytest.fixture(scope="session")
def tf4() -> str:
    """The transformers 4.57 consumer environment's python (.venv-tf4, or PREQUANT_TF4_PYTHON): skipped without it,
    except under CI, which builds it (`bash scripts/setup.sh tf4`) and fails without it."""
    python = os.environ.get("PREQUANT_TF4_PYTHON") or str(ROOT / ".venv-tf4" / "bin" / "python")
    if not Path(python).is_file():
        if os.environ.get("CI"):
            pytest.fail(f"{python} is missing: .ci/run builds it with `bash scripts/setup.sh tf4`")
        pytest.skip("no transformers 4.x environment: bash scripts/setup.sh tf4 (or set PREQUANT_TF4_PYTHON)")
    version = subprocess.run([python, "-c", "import transformers; print(transformers.__version__)"],
                             capture_output=True, text=True, check=True).stdout.strip()
    assert version.startswith("4.57"), version
    return python
