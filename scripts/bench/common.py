"""What the benchmarks share: a command run as a whole process with its memory sampled, the page cache dropped
before it, the disk's own floors, prequant's trace, and the environment that runs this checkout's prequant.

  run_env         os.environ with this checkout (or another tree) first on PYTHONPATH
  drop_caches     flush and drop the page cache (root only); with `warm_libraries` then import the libraries
                  both converters import, so that only the checkpoint is cold
  timed           run a command: wall time, CPU time of the children, peak RssAnon / RssFile / VmRSS of the
                  process and all its descendants (prequant's layout child included), summed, sampled every
                  20 ms from /proc; with `gpu` its own GPU memory, per process, from NVML
  cold_read       `cat` of every shard to /dev/null: how fast the disk gives the source
  read_write_floor the same cat while dd durably writes as many bytes as the output: the disk's floor for any
                  converter that reads the source and writes its result durably
  run_prequant    `python -m prequant convert SOURCE OUT --json` timed, with its trace and weight hashes
  read_trace      prequant's own timeline (PREQUANT_TRACE): events and busy time per stage
  emit            the JSON report, to a file or stdout

GPU memory: torch's counters (max_memory_reserved) miss the CUDA context, cuBLAS/bitsandbytes workspaces and
anything outside torch's caching allocator; the device total includes every other process. What a user with a
smaller GPU needs is the process's own figure, which NVML reports per process: `nvidia-smi
--query-compute-apps=pid,used_memory`. Inside a container NVML may report host PIDs, which never match the
tree's; then the figure is the sum over processes that appeared after sampling started (`match` says which).
No GPU or no nvidia-smi: every figure is None.

Standard library only (and this checkout's standard-library modules of prequant): the benchmarks' own process
does not import torch.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # this checkout's prequant

from prequant.util.pagecache import whole_disk  # noqa: E402 - standard library only, like this module

MIB = 2**20
QUERY = ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"]
TRACE_FILE = "prequant-trace.json"
WARM_LIBRARIES = (
    "import torch, bitsandbytes.functional, transformers, prequant.cli, prequant.conversion.run\n"
    "from transformers import AutoModelForCausalLM, BitsAndBytesConfig, LlamaForCausalLM\n"
    "if torch.cuda.is_available(): torch.zeros(1, device='cuda')"
)


def run_env(tree: Path = ROOT, **extra: str) -> dict:
    """os.environ with `tree` (default: this checkout) first on PYTHONPATH, and `extra` set."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")]), **extra}


def drop_caches(warm_libraries: bool = False) -> bool:
    """Flush and drop the page cache so the next read comes from the disk; False when not permitted.

    `warm_libraries`: then import what both converters import (torch, CUDA, transformers, bitsandbytes) in
    a throwaway process, so only the checkpoint is cold, as on a machine that has run Python since boot."""
    try:
        subprocess.run(["sync"], check=True)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        return False
    if warm_libraries:
        subprocess.run([sys.executable, "-c", WARM_LIBRARIES], check=True, env=run_env())
    return True


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def timed(cmd: list[str], env: dict | None = None, gpu: bool = False, memory: bool = True,
          cwd: Path | None = None) -> dict:  # fmt: skip
    """Run a command, sampling its memory (with `gpu` also its own GPU memory, per process, from NVML; without
    `memory` nothing is sampled, for figures that a sampler's own CPU use would blur); return wall time, the CPU
    seconds of the children waited for meanwhile, the peaks and its stdout. A failed command ends the benchmark."""
    cpu, start = _children_cpu(), time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd)
    sampler = Sampler(proc.pid) if memory else None
    gpu_sampler = GpuSampler(lambda: process_tree(proc.pid)) if gpu else None
    stdout, stderr = proc.communicate()
    wall = time.monotonic() - start
    peaks = sampler.join() if sampler else dict.fromkeys(Sampler.FIELDS)
    gpu_peaks = gpu_sampler.stop() if gpu_sampler else {"peak_gpu_process_bytes": None, "gpu_process_match": None}
    if proc.returncode != 0:
        raise SystemExit(f"{cmd[:4]} failed ({proc.returncode}):\n{stderr[-3000:]}")
    return {"seconds": round(wall, 2), "cpu_seconds": round(_children_cpu() - cpu, 2),
            "peak_rss_anon": peaks["RssAnon"], "peak_rss_file": peaks["RssFile"], "peak_vm_rss": peaks["VmRSS"],
            **gpu_peaks, "stdout": stdout, "stderr_tail": stderr[-500:]}  # fmt: skip


def cold_read(shards: list[Path]) -> dict:
    """`cat` of every shard to /dev/null (the caller drops the page cache first): how fast the disk gives the source."""
    return timed(["sh", "-c", 'cat "$@" > /dev/null', "cat", *map(str, shards)])


def read_write_floor(shards: list[Path], output_bytes: int, work: Path) -> dict:
    """The disk's own floor for any converter, from a cold page cache: read the source while durably writing as
    many bytes as the output (dd, fsync'd, into a scratch file under `work`)."""
    drop_caches()
    scratch = work / "write-floor.bin"
    script = 'dd if=/dev/zero of="$1" bs=64M count="$2" conv=fsync status=none & shift 2; cat "$@" > /dev/null; wait'
    try:
        return timed(["sh", "-c", script, "sh", str(scratch), str(-(-output_bytes // 2**26)), *map(str, shards)])
    finally:
        scratch.unlink(missing_ok=True)


def read_trace(path: Path, origin: float | None = None) -> dict:
    """prequant's own timeline (PREQUANT_TRACE): events as seconds since `origin` (a time.time(), e.g. when the
    process was spawned; None: its first event), and busy time per stage; {} where the run wrote none."""
    try:
        t = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    events = t["events"]
    if origin is None:
        origin = events[0][1] if events else 0.0
    return {"events": {name: round(at - origin, 2) for name, at in events}, "busy": t.get("busy", {})}


def run_prequant(source: str, out: Path, device: str, work: Path, extra_args: tuple[str, ...] | list[str] = (),
                 extra_env: dict | None = None) -> dict:  # fmt: skip
    """`python -m prequant convert SOURCE OUT --device DEVICE --json` as a whole process: wall, memory, GPU memory
    (torch's peak reserved and NVML's per process), output size, its trace and the sha256 of every weight file."""
    shutil.rmtree(out, ignore_errors=True)
    trace_file = work / TRACE_FILE
    trace_file.unlink(missing_ok=True)  # a run that writes none must not show the last one's
    spawned = time.time()
    r = timed([sys.executable, "-m", "prequant", "convert", source, str(out), "--device", device, "--json",
               *extra_args], env=run_env(PREQUANT_TRACE=str(trace_file), **(extra_env or {})), gpu=device != "cpu")
    r["trace"] = read_trace(trace_file, spawned)
    summary = json.loads(r.pop("stdout"))
    r["peak_gpu_bytes"] = summary.get("peak_gpu_bytes")  # torch's max_memory_reserved
    r["output_bytes"] = summary["output_bytes"]
    r["weight_sha256"] = weight_hashes(out)
    return r


def emit(report: dict, path: Path | None, indent: int = 1) -> None:
    """The JSON report: written to `path`, or printed on stdout without one."""
    text = json.dumps(report, indent=indent)
    if path:
        path.write_text(text)
    else:
        print(text)


def weight_hashes(out: Path) -> dict[str, str]:
    """sha256 of each weight file and the index, from the output's manifest (prequant.json): the bytes that
    must not depend on how the conversion ran (the card and manifest name the source and the run)."""
    files = json.loads((out / "prequant.json").read_text())["files"]
    return {name: f["sha256"] for name, f in sorted(files.items())
            if name.endswith(".safetensors") or name.endswith(".safetensors.index.json")}


class Periodic:
    """A daemon thread that calls `sample()` every `interval` s until `_halt()` (or until `sample` returns False)."""

    def __init__(self, interval: float, start: bool = True) -> None:
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        if start:
            self._thread.start()

    def sample(self) -> bool | None:
        raise NotImplementedError

    def _run(self) -> None:
        while not self._stop.is_set() and self.sample() is not False:
            self._stop.wait(self.interval)

    def _halt(self, timeout: float | None = None) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)


def status_bytes(pid: int | str, fields: tuple[str, ...]) -> dict[str, int] | None:
    """The `fields` (kB lines such as RssAnon, VmHWM) of /proc/PID/status in bytes; None once the process is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    found = dict.fromkeys(fields, 0)
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in found:
            found[key] = int(value.split()[0]) * 1024
    return found


class Sampler(Periodic):
    """Samples the memory of a process and all its descendants (prequant's layout child included) from
    /proc every `interval` until the process exits; keeps the peaks of their sums."""

    FIELDS = ("RssAnon", "RssFile", "VmRSS")

    def __init__(self, pid: int, interval: float = 0.02) -> None:
        self.pid = pid
        self.peak = dict.fromkeys(self.FIELDS, 0)
        super().__init__(interval)

    def sample(self) -> bool:
        if not Path(f"/proc/{self.pid}").exists():
            return False
        total = dict.fromkeys(self.FIELDS, 0)
        for pid in process_tree(self.pid):
            for key, value in (status_bytes(pid, self.FIELDS) or {}).items():  # {}: exited meanwhile
                total[key] += value
        for key, value in total.items():
            self.peak[key] = max(self.peak[key], value)
        return True

    def join(self) -> dict[str, int]:
        self._thread.join(timeout=1)
        return self.peak


def process_tree(pid: int) -> list[int]:
    """`pid` and its descendants, from /proc/PID/task/*/children."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        for task in Path(f"/proc/{p}/task").glob("*/children"):
            try:
                todo += [int(c) for c in task.read_text().split()]
            except OSError:
                pass
    return found


def parse_compute_apps(text: str) -> dict[int, int]:
    """nvidia-smi's `pid, used_memory` CSV lines (MiB, no units) -> {pid: bytes}; unparsable lines skipped."""
    used: dict[int, int] = {}
    for line in text.splitlines():
        pid, _, mib = line.partition(",")
        try:
            used[int(pid)] = used.get(int(pid), 0) + int(float(mib)) * MIB
        except ValueError:
            continue  # "[N/A]" and the like
    return used


def compute_apps() -> dict[int, int] | None:
    """{pid: GPU bytes} for every compute process now, or None where nvidia-smi cannot say."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        done = subprocess.run(QUERY, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return parse_compute_apps(done.stdout) if done.returncode == 0 else None


class GpuSampler(Periodic):
    """Samples per-process GPU memory every `interval` s until `stop`; keeps the peak of the tree's sum."""

    def __init__(self, tree, interval: float = 0.2) -> None:
        self.tree = tree  # tree(): the pids of the process and its descendants
        self.before = compute_apps()
        self.available = self.before is not None
        self.peak: int | None = 0 if self.available else None
        self.match: str | None = None
        super().__init__(interval, start=self.available)

    def sample(self) -> None:
        apps = compute_apps()
        if apps is None:
            return
        pids = set(self.tree())
        mine = {p: b for p, b in apps.items() if p in pids}
        if mine:
            self.match = "pid"
            total = sum(mine.values())
        elif self.match != "pid":
            new = {p: b for p, b in apps.items() if p not in (self.before or {})}
            if not new:
                return
            self.match = "new-processes"
            total = sum(new.values())
        else:
            return
        self.peak = max(self.peak or 0, total)

    def stop(self) -> dict:
        """{"peak_gpu_process_bytes", "gpu_process_match"}: the figures, None where not available."""
        self._halt(timeout=15)
        return {"peak_gpu_process_bytes": self.peak if self.match else None, "gpu_process_match": self.match}


class DiskUsagePeak(Periodic):
    """Peak bytes used on the file system of `path` beyond what was used when sampling started."""

    def __init__(self, path: Path, interval: float = 0.05) -> None:
        self.path = path
        self.base = shutil.disk_usage(path).used
        self.peak = 0
        super().__init__(interval)

    def sample(self) -> None:
        self.peak = max(self.peak, shutil.disk_usage(self.path).used - self.base)

    def stop(self) -> int:
        self._halt()
        return self.peak


class DiskSampler(Periodic):
    """The disk that holds `path`, sampled from /proc/diskstats every `interval` s while a command runs: bytes read
    and written and the share of time the device was busy, per second (`timeline`). Where the device cannot be
    found (no /proc/diskstats, an overlay or network filesystem), the timeline is empty."""

    def __init__(self, path: Path, interval: float = 0.1) -> None:
        self.device = disk_of(path)
        self.rows: list[tuple] = []
        self._start = time.monotonic()
        super().__init__(interval, start=bool(self.device))

    def sample(self) -> None:
        counters = diskstats().get(self.device)
        if counters is not None:
            self.rows.append((time.monotonic() - self._start, *counters))

    def stop(self) -> list[dict]:
        """Stop sampling; the timeline (`timeline`)."""
        self._halt()
        return timeline(self.rows)


def diskstats(text: str | None = None) -> dict[str, tuple[int, int, int]]:
    """{device: (bytes read, bytes written, ms busy)} from /proc/diskstats (or its `text`)."""
    if text is None:
        try:
            text = Path("/proc/diskstats").read_text()
        except OSError:
            return {}
    out = {}
    for line in text.splitlines():
        f = line.split()
        if len(f) >= 13:  # sectors are 512 bytes whatever the device's own size (the kernel's iostats.rst)
            out[f[2]] = (int(f[5]) * 512, int(f[9]) * 512, int(f[12]))
    return out


def timeline(rows: list[tuple], step: float = 1.0) -> list[dict]:
    """Per `step` seconds from (t, read, written, busy ms) samples: {t, read_gbps, write_gbps, busy} (busy: 0-1)."""
    out, last = [], None
    for row in rows:
        if last is not None and row[0] - last[0] < step - 1e-6:
            continue
        if last is not None:
            dt = row[0] - last[0]
            out.append({"t": round(last[0], 1), "read_gbps": round((row[1] - last[1]) / dt / 1e9, 2),
                        "write_gbps": round((row[2] - last[2]) / dt / 1e9, 2),
                        "busy": round(min(1.0, (row[3] - last[3]) / dt / 1000), 2)})  # fmt: skip
        last = row
    return out


def disk_of(path: Path) -> str:
    """The /proc/diskstats name of the whole disk holding `path` ('' where none is found)."""
    try:
        name = whole_disk(Path(path).stat().st_dev).resolve().name
    except OSError:
        return ""
    return name if name in diskstats() else ""
