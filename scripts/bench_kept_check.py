"""What the NaN/Inf check of a kept tensor costs beside the copy a conversion makes of it anyway.

A conversion copies a kept tensor file to file with copy_file_range; the check (`conversion.kept.non_finite`)
reads the same bytes once through the memory map first. This writes one safetensors file holding a single
kept tensor (1 GiB of bf16 by default), reads it once so both measurements start from a warm page cache, then
times, each `--repeat` times, the copy alone and the check alone, and prints their medians and the ratio.

    python scripts/bench_kept_check.py [--gib 1] [--repeat 5] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from safetensors.torch import save_file  # noqa: E402

from prequant.checkpoint.reader import TensorReader, scan_files  # noqa: E402
from prequant.conversion.kept import non_finite  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--dir", default=tempfile.gettempdir())
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        path = Path(tmp) / "model.safetensors"
        n = int(args.gib * 2**30) // 2
        save_file({"model.embed_tokens.weight": torch.randn(n // 4096, 4096).to(torch.bfloat16)}, path)
        (ref,) = scan_files([path])
        with open(path, "rb") as f:
            while f.read(64 << 20):  # into the page cache: both timings below read from memory
                pass
        copies, checks = [], []
        with TensorReader() as data:
            src = data.fd(path)
            for i in range(args.repeat):
                out = Path(tmp) / f"copy{i}"
                dst = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                t = time.perf_counter()
                done = 0
                while done < ref.nbytes:
                    done += os.copy_file_range(src, dst, ref.nbytes - done, ref.offset + done, done)
                copies.append(time.perf_counter() - t)
                os.close(dst)
                out.unlink()
                t = time.perf_counter()
                assert non_finite(data.view(ref)) == (0, 0)
                checks.append(time.perf_counter() - t)
    copy, check = statistics.median(copies), statistics.median(checks)
    print(f"kept tensor: {ref.nbytes / 2**30:.2f} GiB bf16, page cache warm, torch threads {torch.get_num_threads()}")
    print(f"copy_file_range: {copy:.3f} s ({ref.nbytes / copy / 1e9:.2f} GB/s)")
    print(f"non_finite check: {check:.3f} s ({ref.nbytes / check / 1e9:.2f} GB/s)")
    print(f"check / copy: {check / copy:.2f}")


if __name__ == "__main__":
    main()
