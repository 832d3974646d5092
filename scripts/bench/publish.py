"""Convert and publish: `prequant convert --push-to-hub` against `prequant convert` then `prequant upload`.

Generates a checkpoint (`synthetic.py`, uniform 32 MiB tensors by default), serves the tests' local Hub
(tests/hub_server.py, its plain LFS upload path, in this process) and measures, as whole processes:

  push        prequant convert SRC OUT --device D --push-to-hub REPO: shards upload while the next ones convert
  sequential  prequant convert SRC OUT --device D, then prequant upload OUT REPO: the sum of both

Each mode gets a fresh server (an object the Hub holds already is not sent again, so a second mode on the same
server would send nothing). The source is read once before both, so that both read it from the page cache. The
server runs on this machine: its hashing and storing of the objects share the CPU with prequant, as a remote Hub's
would not. Prints both times and their ratio; --json FILE also writes the report.

    python scripts/bench/publish.py --size-gb 2 --device cpu --json publish.json
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

from common import ROOT, emit, run_env, timed
from synthetic import generated


def measure(src: Path, work: Path, device: str, shard: str) -> dict:
    """Both modes, each against its own fresh server; the seconds of each and their ratio."""
    sys.path.insert(0, str(ROOT / "tests"))
    from hub_server import TOKEN, HubServer  # the tests' local Hub (it imports pytest, a test dependency)

    convert = [sys.executable, "-m", "prequant", "convert", str(src)]
    options = ["--device", device, "--max-shard-size", shard, "--json"]
    report: dict = {"device": device, "source_bytes": sum(f.stat().st_size for f in src.glob("*.safetensors"))}
    subprocess.run(["sh", "-c", 'cat "$@" > /dev/null', "cat", *map(str, src.glob("*.safetensors"))], check=True)
    for mode in ("sequential", "push"):
        out = work / f"out-{mode}"
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(work / f"hub-{mode}", ignore_errors=True)
        with HubServer(work / f"hub-{mode}") as server:
            env = run_env(HF_ENDPOINT=server.url, HF_HUB_DISABLE_XET="1", HF_TOKEN=TOKEN, HF_HOME=str(work / "hf-home"),
                          HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_OFFLINE="0", PREQUANT_PROGRESS="none")  # fmt: skip
            if mode == "push":
                started = time.time()
                r = timed([*convert, str(out), *options, "--push-to-hub", "bench/pushed"], env=env)
                puts = [q.at - started for q in server.request_log if q.method == "PUT"]
                written = [p.stat().st_mtime - started for p in out.glob("*.safetensors")]
                report["push"] = {"seconds": r["seconds"], "peak_vm_rss": r["peak_vm_rss"],
                                  # the overlap: objects sent while shards were still being written
                                  "first_object_sent_s": round(min(puts), 2), "last_object_sent_s": round(max(puts), 2),
                                  "last_shard_written_s": round(max(written), 2), "objects_sent": len(puts)}
            else:
                c = timed([*convert, str(out), *options], env=env)
                u = timed([sys.executable, "-m", "prequant", "upload", str(out), "bench/pushed"], env=env)
                report["sequential"] = {"seconds": round(c["seconds"] + u["seconds"], 2), "convert_seconds": c["seconds"],
                                        "upload_seconds": u["seconds"],
                                        "objects_sent": sum(q.method == "PUT" for q in server.request_log)}  # fmt: skip
            uploaded = server.files("bench/pushed")
            local = {p.name for p in out.iterdir() if p.is_file() and not p.name.startswith(".")}
            if set(uploaded) - {".gitattributes"} != local or len(server.commits("bench/pushed")) != 2:
                raise SystemExit(f"{mode}: the repo does not hold the output in one commit")
            report[mode]["weight_bytes"] = sum(p.stat().st_size for p in out.glob("*.safetensors"))
        shutil.rmtree(work / f"hub-{mode}", ignore_errors=True)
    report["ratio"] = round(report["push"]["seconds"] / report["sequential"]["seconds"], 3)
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gb", type=float, default=2)
    ap.add_argument("--shape", choices=["uniform", "llama"], default="uniform")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--max-shard-size", default="200MB", help="output shards (several, so that uploads overlap)")
    ap.add_argument("--dir", type=Path, default=Path("/tmp/prequant-bench-publish"))
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    src = generated(args.shape, args.size_gb, args.dir, shard_gb=max(0.05, args.size_gb / 4))
    report = measure(src, args.dir, args.device, args.max_shard_size)
    print(f"push-to-hub {report['push']['seconds']:.1f}s, convert then upload {report['sequential']['seconds']:.1f}s "
          f"(convert {report['sequential']['convert_seconds']:.1f}s + upload "
          f"{report['sequential']['upload_seconds']:.1f}s), ratio {report['ratio']:.2f}", file=sys.stderr)
    emit(report, args.json)


if __name__ == "__main__":
    main()
