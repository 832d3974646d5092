"""The Hub path at scale: `prequant convert <hub repo> OUT` from a real HTTP endpoint, its faults, its scratch disk.

Serves a generated checkpoint (`synthetic.py`: Grok-1 or Llama shapes, safetensors or PyTorch `.bin` shards) from
the tests' local Hub (tests/hub_server.py, the subset of the Hub API that huggingface_hub uses; its files hard links
on the same disk), then measures, each from a cold page cache:

  floor       curl fetching every file of the repo through that server (one connection, as huggingface_hub uses) to
              /dev/null, while dd writes and fsyncs as many bytes as the output: the floor of any converter that
              reads this endpoint once and writes its result durably
  download    huggingface_hub alone, in a fresh process (hf_hub_download of every file, each shard deleted once
              fetched, as --delete-source-shards does), and prequant's own transfer of the shards alone the same way
              (`prequant.hub.transfer`, what a conversion downloads them with unless Xet stores them)
  convert     prequant convert REPO OUT --device D --delete-source-shards, the whole process: wall time, RssAnon /
              RssFile / VmRSS of its process tree (the download child included), the scratch disk (the Hugging Face
              cache: every file's allocated bytes, partial downloads included, sampled every 50 ms) against two
              source shards, the disk's timeline, prequant's own timeline
  fault       --faults: the same, the server cutting shard K's body mid-way once and then answering 503 three times
              to the ranged requests that resume it
  variant     --variant KEY=VALUE (repeatable; several variables: 'K1=V1 K2=V2'; the same one twice runs twice, the
              second as 'KEY=VALUE #2'): the conversion again with that environment, e.g.
              PREQUANT_HUB_CLIENT=huggingface_hub or PREQUANT_HUB_DOWNLOADS=1
  kill        --kill: the same, SIGKILLed while shard K is half downloaded, then the same command with --resume:
              the partial files the kill left, the resumed run's time and scratch disk

The server reads the repo from this machine's disk, the disk prequant's libraries, scratch and output are on: a
remote Hub's disk is not. --endpoint-warm reads the served files into the page cache after every drop, so that
the endpoint's reads leave the disk to the client (floor and conversions alike) while the libraries, the scratch
and the output stay cold: the case of a real endpoint, whose bytes come over the network only.

Every run's weight files are compared (sha256) with the first conversion's, and with a local conversion's when one
was measured beside it (`--local-sha256 FILE`, a report of convert.py). The report is written after every step.

    python scripts/bench/hub_scale.py --shape grok --size-gb 33 --device cuda --faults --kill --json hub.json
    python scripts/bench/hub_scale.py --shape grok --layers 3 --format bin --model-code --keep-output OUT ...
    python scripts/bench/hub_scale.py --shape grok --size-gb 33 --variant PREQUANT_HUB_CLIENT=huggingface_hub
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from common import (
    ROOT, DiskSampler, DiskUsagePeak, Periodic, drop_caches, emit, read_trace, run_env, run_prequant, timed,
    weight_hashes,
)
from hub_path import DOWNLOAD, HASHES, REPO_PREFIX, filesystem, source_hashes
from synthetic import generate

# prequant's transfer alone: every shard through `client.download(large=True)` (what the download child runs),
# each deleted once fetched, as DOWNLOAD does with huggingface_hub.
TRANSFER = r"""
import os, sys
from prequant.hub import client
commit = client.resolve(sys.argv[1])
for name in sorted(commit.files):
    if name.endswith((".safetensors", ".bin")):
        os.remove(os.path.realpath(client.download(commit, name, large=True)))
"""



class ScratchPeak(Periodic):
    """The bytes the files under `folder` (the Hugging Face cache) take on disk, sampled: the peak of all of them, the
    peak of the source shards' (their blobs, named by sha256, and their partial downloads, huggingface_hub's
    <sha256>.<8 hex>.incomplete), and the partial files seen."""

    def __init__(self, folder: Path, shards: set[str], interval: float = 0.05) -> None:
        self.folder, self.shards = folder, shards
        self.peak = self.shard_peak = 0
        self.at_peak: dict[str, int] = {}  # the source shards' files at that peak: sha256 (12 digits) -> bytes
        self.partials: set[str] = set()
        super().__init__(interval)

    def sample(self) -> None:
        total, per_shard = 0, {}
        for _, name, size in [*self._named(), *self._deleted_open()]:
            total += size
            sha = name.split(".", 1)[0]
            if sha in self.shards:
                # A partial file renamed to its blob while the folder is listed can be listed under both names:
                # one shard, counted once.
                per_shard[sha] = max(per_shard.get(sha, 0), size)
            if name.endswith(".incomplete"):
                self.partials.add(name)
        self.peak = max(self.peak, total)
        if sum(per_shard.values()) > self.shard_peak:
            self.shard_peak = sum(per_shard.values())
            self.at_peak = {sha[:12]: size for sha, size in per_shard.items()}

    def _named(self):
        """(folder, name, bytes allocated) of every file under the folder."""
        for root, _, names in os.walk(self.folder):
            for name in names:
                try:
                    yield root, name, os.lstat(os.path.join(root, name)).st_blocks * 512
                except OSError:
                    continue

    def _deleted_open(self):
        """The same for files under the folder that are deleted but still open in some process (a shard that
        freeing as it converts took out of the cache), each inode once."""
        seen: set[int] = set()
        prefix = str(self.folder)
        for fd in glob.glob("/proc/[0-9]*/fd/*"):
            try:
                target = os.readlink(fd)
                if not (target.startswith(prefix) and target.endswith(" (deleted)")):
                    continue
                st = os.stat(fd)
            except OSError:
                continue
            if st.st_ino not in seen:
                seen.add(st.st_ino)
                yield os.path.dirname(target), os.path.basename(target.removesuffix(" (deleted)")), st.st_blocks * 512

    def stop(self) -> tuple[int, int]:
        """(peak of all, peak of the source shards)"""
        self._halt()
        return self.peak, self.shard_peak


def partials(cache: Path) -> list[str]:
    """huggingface_hub's partial downloads under `cache` (name and size)."""
    return [f"{p.name} ({p.stat().st_size})" for p in cache.rglob("*.incomplete")]


# Where curl is missing: the standard library's client, 16 MiB reads (what curl would be, one connection).
FETCH = r"""
import sys, urllib.request
for url in sys.argv[1:]:
    with urllib.request.urlopen(url) as r:
        while r.read(1 << 24):
            pass
"""


def curl_floor(url: str, repo: str, files: list[str], output_bytes: int, work: Path, drop) -> dict:
    """curl of every file through the server to /dev/null (following the LFS redirect), beside dd's durable write
    of the output's bytes: see the module doc. `drop()` drops the page cache first."""
    drop()
    scratch = work / "write-floor.bin"
    urls = [f"{url}/{repo}/resolve/main/{name}" for name in files]
    fetch = ('for u in "$@"; do curl -sSfL -o /dev/null "$u" || exit 1; done' if shutil.which("curl")
             else f'{sys.executable} -c "$FETCH" "$@"')
    script = f'dd if=/dev/zero of="$1" bs=64M count="$2" conv=fsync status=none & shift 2; {fetch}; wait'
    try:
        r = timed(["sh", "-c", script, "sh", str(scratch), str(-(-output_bytes // 2**26)), *urls],
                  env={**os.environ, "FETCH": FETCH})
        r["client"] = "curl" if shutil.which("curl") else "urllib"
        return r
    finally:
        scratch.unlink(missing_ok=True)


def convert_hub(repo: str, out: Path, args, hub_env: dict, cache: Path, shards: set[str], extra: tuple[str, ...] = (),
                kill_when=None) -> dict:  # fmt: skip
    """One `prequant convert REPO OUT` process with its scratch disk (`shards`: the source shards' blob names),
    disk timeline and memory sampled; with `kill_when(cache)`, SIGKILLed once that holds (no summary then)."""
    trace_file = args.dir / "prequant-trace.json"
    trace_file.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "prequant", "convert", repo, str(out), "--device", args.device, "--json",
           "--delete-source-shards", *args.prequant_arg, *extra]
    env = run_env(PREQUANT_TRACE=str(trace_file), **hub_env)
    scratch, disk, fs_peak = ScratchPeak(cache, shards), DiskSampler(args.dir), DiskUsagePeak(args.dir)
    spawned = time.time()
    if kill_when is None:
        r = timed(cmd, env=env, gpu=args.device != "cpu")
        summary = json.loads(r.pop("stdout"))
        r.update(output_bytes=summary["output_bytes"], peak_gpu_bytes=summary.get("peak_gpu_bytes"),
                 weight_sha256=weight_hashes(out))
    else:
        start = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
        err: list[str] = []
        reader = threading.Thread(target=lambda: err.append(proc.stderr.read()), daemon=True)
        reader.start()
        while proc.poll() is None and not kill_when(cache):
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        reader.join(5)
        r = {"seconds": round(time.monotonic() - start, 2), "returncode": proc.returncode,
             "stderr_tail": "".join(err)[-500:]}
    r["scratch_peak_bytes"], r["scratch_shards_peak_bytes"] = scratch.stop()
    r["scratch_shards_at_peak"] = scratch.at_peak
    r["partials_seen"] = len(scratch.partials)
    r["fs_peak_extra_bytes"] = fs_peak.stop()
    r["disk_timeline"] = disk.stop()
    r["trace"] = read_trace(trace_file, spawned)
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="grok", choices=("grok", "llama", "uniform"))
    ap.add_argument("--size-gb", type=float, default=33)
    ap.add_argument("--layers", type=int, help="decoder layers instead of --size-gb")
    ap.add_argument("--format", default="safetensors", choices=("safetensors", "bin"))
    ap.add_argument("--model-code", action="store_true", help="grok: the remote-code model files too (never run)")
    ap.add_argument("--dims", type=json.loads, default=None, metavar="JSON", help="synthetic.py's --dims (smoke runs)")
    ap.add_argument("--shard-gb", type=float, default=5.0, help="source shard size")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dir", type=Path, default=Path("/tmp/prequant-hub-scale"))
    ap.add_argument("--prequant-arg", action="append", default=[], metavar="ARG")
    ap.add_argument("--faults", action="store_true", help="also a run through a cut and a 503 burst")
    ap.add_argument("--kill", action="store_true", help="also a run SIGKILLed mid-download, then --resume")
    ap.add_argument("--fault-shard", type=int, default=3, help="the shard (1-based, in download order) faults hit")
    ap.add_argument("--skip-download", action="store_true", help="no download-alone runs")
    ap.add_argument("--repeats", type=int, default=1, help="the first conversion this many times (a median)")
    ap.add_argument("--variant", action="append", default=[], metavar="KEY=VALUE",
                    help="the conversion again with this environment (repeatable; 'K1=V1 K2=V2' sets several)")
    ap.add_argument("--local-sha256", type=Path, help="convert.py's JSON report of the same checkpoint, local")
    ap.add_argument("--local", action="store_true", help="also convert the served folder from disk, cold, and "
                    "compare its bytes (what --local-sha256 gives where convert.py measured it)")
    ap.add_argument("--keep-output", type=Path, help="move the first conversion's output here")
    ap.add_argument("--endpoint-warm", action="store_true", help="the served files read into the page cache "
                    "after every drop: the endpoint off this disk, as a remote Hub is")
    ap.add_argument("--json", type=Path, help="the report (written after every step)")
    args = ap.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)

    sys.path.insert(0, str(ROOT / "tests"))
    from hub_server import HubServer  # the tests' local Hub (it imports pytest, a test dependency)

    plain = args.format == "safetensors" and not (args.layers or args.dims or args.model_code) and args.shard_gb == 5
    # The checkpoint convert.py and window.py measure (synthetic.generated's folder), when it is that one.
    name = f"{args.shape}-{args.size_gb:g}gb" if plain else (
        f"{args.shape}-{args.format}-{args.layers or args.size_gb:g}{'l' if args.layers else 'gb'}")
    src = args.dir / name
    report: dict = {"shape": args.shape, "format": args.format, "device": args.device, "cpus": os.cpu_count(),
                    "filesystem": filesystem(args.dir)}
    if not (src / "config.json").exists():
        t = time.monotonic()
        generate(args.shape, args.size_gb, src, args.shard_gb, layers=args.layers, dims=args.dims,
                 model_code=args.model_code, fmt=args.format)
        report["generated_seconds"] = round(time.monotonic() - t, 1)
    hashes = source_hashes(src)  # while the new shards are still in the page cache
    files = {p.name: p for p in sorted(src.iterdir()) if p.is_file() and p.name != HASHES}
    shards = [n for n in files if n.endswith((".safetensors", ".bin"))]
    shard_blobs = {hashes[n] for n in shards}  # the names of their blobs in the Hugging Face cache (LFS: sha256)
    report.update(source_bytes=sum(files[n].stat().st_size for n in shards), shards=len(shards),
                  largest_shard_bytes=max(files[n].stat().st_size for n in shards))
    block = os.statvfs(args.dir).f_frsize
    # Two shards on disk: the scratch figure counts allocated blocks, so the bound is in whole blocks too.
    report["scratch_bound_bytes"] = 2 * -(-report["largest_shard_bytes"] // block) * block
    repo = f"{REPO_PREFIX}/{name}"
    server_root, hf_home = args.dir / "hub-server", args.dir / "hub-hf-home"
    cache = hf_home / "hub"
    out = args.dir / "out-hub"
    shutil.rmtree(server_root, ignore_errors=True)

    def save() -> None:
        emit(report, args.json)

    report["endpoint"] = "warm" if args.endpoint_warm else "cold"

    def drop() -> None:
        """A cold page cache; with --endpoint-warm, then the served files read back into it."""
        drop_caches()
        if args.endpoint_warm:
            t = time.monotonic()
            subprocess.run(["cat", *map(str, files.values())], stdout=subprocess.DEVNULL, check=True)
            report.setdefault("endpoint_warm_seconds", []).append(round(time.monotonic() - t, 2))

    with HubServer(server_root) as server:
        server.add_repo(repo, files, link=True, sha256s=hashes)
        hub_env = {**server.env, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "0", "HF_HUB_DISABLE_TELEMETRY": "1",
                   "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
        order = _download_order(src, shards)
        fault_name = order[min(args.fault_shard, len(order)) - 1]

        def fresh() -> None:
            shutil.rmtree(out, ignore_errors=True)
            shutil.rmtree(hf_home, ignore_errors=True)

        fresh()
        drop()
        first = report["convert"] = convert_hub(repo, out, args, hub_env, cache, shard_blobs)
        first["within_scratch_bound"] = first["scratch_shards_peak_bytes"] <= report["scratch_bound_bytes"]
        reference = first["weight_sha256"]
        if args.local_sha256:
            local = json.loads(args.local_sha256.read_text())["prequant"]["weight_sha256"]
            first["same_bytes_as_local"] = reference == local
        output_bytes = first["output_bytes"]
        save()
        for _ in range(args.repeats - 1):
            fresh()
            drop()
            again = convert_hub(repo, out, args, hub_env, cache, shard_blobs)
            first.setdefault("repeats", []).append({k: again[k] for k in ("seconds", "peak_rss_anon",
                                                                         "scratch_shards_peak_bytes", "trace")})
            first.setdefault("repeats_same_bytes", []).append(again["weight_sha256"] == reference)
        if args.repeats > 1:
            first["repeat_seconds"] = [first["seconds"]] + [x["seconds"] for x in first["repeats"]]
            first["median_seconds"] = statistics.median(first["repeat_seconds"])
        save()
        if args.keep_output:
            shutil.rmtree(args.keep_output, ignore_errors=True)
            shutil.move(str(out), str(args.keep_output))
        fresh()

        if args.local:
            drop_caches()  # the served files are this folder's: cold, whatever the endpoint's setting
            local_run = run_prequant(str(src), args.dir / "out-local", args.device, args.dir, args.prequant_arg)
            shutil.rmtree(args.dir / "out-local", ignore_errors=True)
            report["local"] = {k: local_run[k] for k in ("seconds", "peak_rss_anon", "output_bytes")}
            first["same_bytes_as_local"] = report["local"]["same_bytes"] = local_run["weight_sha256"] == reference
            save()

        report["floor"] = curl_floor(server.url, repo, list(files), output_bytes, args.dir, drop)
        report["floor"].pop("stdout", None)
        report["convert"]["ratio_to_floor"] = round(first["seconds"] / report["floor"]["seconds"], 3)
        if "median_seconds" in first:
            first["median_ratio_to_floor"] = round(first["median_seconds"] / report["floor"]["seconds"], 3)
        save()

        if args.faults:
            # Cut a third of the way; the download resumes from where it was (a ranged request, past the header
            # reads' offsets): refused three times, then served.
            cut = report["largest_shard_bytes"] // 3
            server.fail(repo, fault_name, "drop", after_bytes=cut, times=1, ranged=False)
            server.fail(repo, fault_name, "status", status=503, times=3, ranged="resume")
            server.clear_log()
            drop()
            r = convert_hub(repo, out, args, hub_env, cache, shard_blobs)
            r["shard"] = fault_name
            r["same_bytes"] = r["weight_sha256"] == reference
            r["bodies"] = [(rec.status, rec.headers.get("range")) for rec in server.request_log  # not header reads
                           if rec.method == "GET" and rec.path.startswith("/cdn-lfs/") and rec.query.get("file") == [fault_name]
                           and rec.to_the_end]
            server.clear_faults()
            report["fault"] = r
            fresh()
            save()

        if args.kill:
            # The server holds shard K's body half sent: the kill comes while that download is surely under way.
            held = server.fail(repo, fault_name, "hold", after_bytes=files[fault_name].stat().st_size // 2, times=1,
                               ranged=False)
            drop()
            killed = convert_hub(repo, out, args, hub_env, cache, shard_blobs, kill_when=lambda _: held.arrived.is_set())
            held.release.set()
            server.clear_faults()
            killed["shard"] = fault_name
            killed["partials_left"] = partials(cache)
            resumed = convert_hub(repo, out, args, hub_env, cache, shard_blobs, ("--resume",))
            resumed["partials_left"] = partials(cache)
            resumed["same_bytes"] = resumed["weight_sha256"] == reference
            resumed["within_scratch_bound"] = resumed["scratch_shards_peak_bytes"] <= report["scratch_bound_bytes"]
            report["kill"] = {"killed": killed, "resumed": resumed}
            fresh()
            save()

        for variant in args.variant:
            env = dict(pair.partition("=")[::2] for pair in variant.split())
            drop()
            v = convert_hub(repo, out, args, {**hub_env, **env}, cache, shard_blobs)
            v["env"] = env
            v["same_bytes"] = v["weight_sha256"] == reference
            v["ratio_to_floor"] = round(v["seconds"] / report["floor"]["seconds"], 3)
            v["within_scratch_bound"] = v["scratch_shards_peak_bytes"] <= report["scratch_bound_bytes"]
            variants = report.setdefault("variants", {})
            # A variant given again is run again, under its own name (it would replace the first run's figures).
            name, k = variant, 1
            while name in variants:
                k += 1
                name = f"{variant} #{k}"
            variants[name] = v
            fresh()
            save()

        if not args.skip_download:
            for key, script in (("download", DOWNLOAD), ("transfer", TRANSFER)):
                drop()
                t = time.monotonic()
                subprocess.run([sys.executable, "-c", script, repo, str(cache)], check=True,
                               env=run_env(**hub_env, HF_HUB_CACHE=str(cache)))
                report[key] = {"seconds": round(time.monotonic() - t, 2)}
                report[key]["gbps"] = round(report["source_bytes"] / report[key]["seconds"] / 1e9, 3)
                fresh()
            report["convert"]["ratio_to_download"] = round(first["seconds"] / report["download"]["seconds"], 3)
            save()
    shutil.rmtree(server_root, ignore_errors=True)
    print_report(report)
    save()


def _download_order(src: Path, shards: list[str]) -> list[str]:
    """The shards in the order prequant downloads them: the index's first mention of each."""
    index = next((src / n for n in ("model.safetensors.index.json", "pytorch_model.bin.index.json")
                  if (src / n).exists()), None)
    if index is None:
        return shards
    return list(dict.fromkeys(json.loads(index.read_text())["weight_map"].values()))


def print_report(r: dict) -> None:
    c, f = r["convert"], r.get("floor", {})
    gb = 1e9
    print(f"\nHub path, {r['source_bytes'] / gb:.1f} GB {r['shape']} {r['format']} in {r['shards']} shards "
          f"(largest {r['largest_shard_bytes'] / gb:.2f} GB), --device {r['device']}, endpoint {r['endpoint']}:",
          file=sys.stderr)
    print(f"  convert {c['seconds']:.1f} s; floor (curl + dd) {f.get('seconds', float('nan')):.1f} s: "
          f"{c.get('ratio_to_floor', float('nan')):.2f}x; huggingface_hub alone "
          f"{r.get('download', {}).get('seconds', float('nan')):.1f} s, prequant's transfer alone "
          f"{r.get('transfer', {}).get('seconds', float('nan')):.1f} s", file=sys.stderr)
    if "median_seconds" in c:
        print(f"  repeats {c['repeat_seconds']} s: median {c['median_seconds']:.1f} s, "
              f"{c['median_ratio_to_floor']:.2f}x, same bytes {c['repeats_same_bytes']}", file=sys.stderr)
    for name, v in r.get("variants", {}).items():
        print(f"  {name}: {v['seconds']:.1f} s, {v['ratio_to_floor']:.2f}x, source shards on disk "
              f"{v['scratch_shards_peak_bytes'] / gb:.2f} GB, same bytes {v['same_bytes']}", file=sys.stderr)
    print(f"  scratch peak {c['scratch_peak_bytes'] / gb:.2f} GB, source shards {c['scratch_shards_peak_bytes'] / gb:.2f} GB "
          f"(two shards: {r['scratch_bound_bytes'] / gb:.2f}); "
          f"RssAnon {c['peak_rss_anon'] / 2**30:.2f} GiB, VmRSS {c['peak_vm_rss'] / 2**30:.2f} GiB", file=sys.stderr)
    if "local" in r:
        print(f"  the same folder converted from disk: {r['local']['seconds']:.1f} s, same bytes "
              f"{r['local']['same_bytes']}", file=sys.stderr)
    if "fault" in r:
        x = r["fault"]
        print(f"  fault on {x['shard']}: {x['seconds']:.1f} s, bodies {x['bodies']}, same bytes {x['same_bytes']}",
              file=sys.stderr)
    if "kill" in r:
        k, s = r["kill"]["killed"], r["kill"]["resumed"]
        print(f"  killed after {k['seconds']:.1f} s (partials left {k['partials_left']}); resumed {s['seconds']:.1f} s,"
              f" scratch peak {s['scratch_peak_bytes'] / gb:.2f} GB, partials left {s['partials_left']}, same bytes "
              f"{s['same_bytes']}", file=sys.stderr)


if __name__ == "__main__":
    main()
