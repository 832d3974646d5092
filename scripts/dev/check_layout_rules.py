"""Check the layout rules (`prequant.bnb.predict`, `prequant.bnb.params`) against several transformers versions:
each is installed into a folder of its own (pip --target, with the dependencies that version resolves to; torch
and the rest come from this interpreter) and tests/bnb/test_predict.py and tests/bnb/test_params.py run with
that folder first on the path. Run it before raising
`predict.VERIFIED`; it prints one line per version and exits 1 if any failed.

    python scripts/dev/check_layout_rules.py 5.17.0 5.20.2 5.24.0 [--cache /tmp/prequant-transformers]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = ["tests/bnb/test_predict.py", "tests/bnb/test_params.py"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("versions", nargs="+")
    ap.add_argument("--cache", type=Path, default=Path("/tmp/prequant-transformers"))
    args = ap.parse_args()
    failed = 0
    for version in args.versions:
        target = args.cache / version
        if not (target / "transformers").is_dir():
            subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--target", str(target),
                            f"transformers=={version}"], check=True)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(target), str(ROOT)])}
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *TESTS], check=False,
                              cwd=ROOT, env=env, capture_output=True, text=True)
        last = (proc.stdout.strip().splitlines() or ["(no output)"])[-1]
        failures = [line.split(" - ")[0] for line in proc.stdout.splitlines() if line.startswith("FAILED")]
        print(f"transformers {version}: {'ok' if proc.returncode == 0 else 'FAILED'}: {last}")
        for line in failures[:8]:
            print(f"  {line}")
        failed += proc.returncode != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
