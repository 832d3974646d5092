"""The lowest versions pyproject.toml declares, as pip constraints: the floor environment of `.ci/run`.

    python3 scripts/dev/floors.py > floors.txt && pip install -c floors.txt torch==2.13.0 -e '.[transformers,fsdp,testtools]'

Each `name>=X` of the runtime dependencies and of the `transformers` and `fsdp` extras becomes `name==X` (the
highest floor when a name appears twice); the `testtools` extra's tools are not part of the range users install, so
they are left free, and the `train` extra (TRL's path, tested at transformers 5.17 and accelerate 1.15,
above these floors) is not part of this environment. torch is the one exception: PyPI's Linux wheels of torch are CUDA builds (several GB with
their nvidia-* dependencies), so the floor environment takes the oldest CPU build within reach, `CPU_TORCH`, and
the declared floor is the torch of the GPU machine, where the GPU suite runs.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = None  # type: ignore[assignment]

ROOT = Path(__file__).resolve().parents[2]
EXTRAS = ("transformers", "fsdp")
CPU_TORCH = "2.13.0"  # the CPU build scripts/setup.sh installs (the oldest on this project's machines)
_FLOOR = re.compile(r"^\s*([A-Za-z0-9_.-]+)\s*(?:\[[^\]]*\])?\s*>=\s*([0-9][0-9A-Za-z.]*)\s*(?:,.*)?$")


def requirements(pyproject: Path = ROOT / "pyproject.toml") -> list[str]:
    """The runtime requirements and those of the `EXTRAS`, as written (self-references to prequant left out)."""
    if tomllib is None:
        raise SystemExit("scripts/dev/floors.py needs Python 3.11 or later (tomllib)")
    project = tomllib.loads(pyproject.read_text())["project"]
    found = list(project["dependencies"])
    for extra in EXTRAS:
        found += [r for r in project["optional-dependencies"][extra] if not r.startswith("prequant")]
    return found


def floors(reqs: list[str]) -> dict[str, str]:
    """name -> lowest version declared; a requirement without a lower bound is an error (no honest floor)."""
    out: dict[str, str] = {}
    for req in reqs:
        m = _FLOOR.match(req)
        if m is None:
            raise SystemExit(f"pyproject.toml: {req!r} has no lower bound (name>=X); declare the version tested")
        name, version = m.group(1).lower().replace("_", "-"), m.group(2)
        if name not in out or _key(version) > _key(out[name]):
            out[name] = version
    return out


def _key(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", version))


def main() -> None:
    pins = floors(requirements())
    for name, version in sorted(pins.items()):
        if name == "torch":
            print(f"# torch>={version} declared; no CPU wheel of it on PyPI, the oldest CPU build here instead")
            version = CPU_TORCH
        print(f"{name}=={version}")


if __name__ == "__main__":
    sys.exit(main())
