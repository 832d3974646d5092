"""The memory a process tree holds while it runs (for bench.py): host memory from /proc, GPU memory per process.

Host: RssAnon / RssFile / VmRSS of the process and all its descendants (prequant's layout child included),
summed, sampled every 20 ms. GPU: sampled from nvidia-smi.

torch's counters (max_memory_reserved) miss the CUDA context, cuBLAS/bitsandbytes workspaces and anything
outside torch's caching allocator; the device total includes every other process. What a user with a
smaller GPU needs is the process's own figure, which NVML reports per process: `nvidia-smi
--query-compute-apps=pid,used_memory`. Inside a container NVML may report host PIDs, which never match the
tree's; then the figure is the sum over processes that appeared after sampling started (`match` says which).
No GPU or no nvidia-smi: every figure is None.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

MIB = 2**20
QUERY = ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"]


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


class GpuSampler:
    """Samples per-process GPU memory every `interval` s until `stop`; keeps the peak of the tree's sum."""

    def __init__(self, tree, interval: float = 0.2) -> None:
        self.tree, self.interval = tree, interval  # tree(): the pids of the process and its descendants
        self.before = compute_apps()
        self.available = self.before is not None
        self.peak: int | None = 0 if self.available else None
        self.match: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        if self.available:
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

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
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=15)
        return {"peak_gpu_process_bytes": self.peak if self.match else None, "gpu_process_match": self.match}


class Sampler:
    """Samples the memory of a process and all its descendants (prequant's layout child included) from
    /proc every `interval` until the process exits; keeps the peaks of their sums."""

    FIELDS = ("RssAnon", "RssFile", "VmRSS")

    def __init__(self, pid: int, interval: float = 0.02) -> None:
        self.pid, self.interval = pid, interval
        self.peak = dict.fromkeys(self.FIELDS, 0)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while Path(f"/proc/{self.pid}").exists():
            total = dict.fromkeys(self.FIELDS, 0)
            for pid in process_tree(self.pid):
                try:
                    text = Path(f"/proc/{pid}/status").read_text()
                except OSError:
                    continue  # exited meanwhile
                for line in text.splitlines():
                    key, _, value = line.partition(":")
                    if key in total:
                        total[key] += int(value.split()[0]) * 1024
            for key, value in total.items():
                self.peak[key] = max(self.peak[key], value)
            time.sleep(self.interval)

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


class DiskSampler:
    """The disk that holds `path`, sampled from /proc/diskstats every `interval` s while a command runs: bytes read
    and written and the share of time the device was busy, per second (`timeline`). Where the device cannot be
    found (no /proc/diskstats, an overlay or network filesystem), the timeline is empty."""

    def __init__(self, path: Path, interval: float = 0.1) -> None:
        self.device = disk_of(path)
        self.interval, self.rows, self._stop = interval, [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        start = time.monotonic()
        while self.device and not self._stop.is_set():
            counters = diskstats().get(self.device)
            if counters is not None:
                self.rows.append((time.monotonic() - start, *counters))
            self._stop.wait(self.interval)

    def stop(self) -> list[dict]:
        """Stop sampling; the timeline (`timeline`)."""
        self._stop.set()
        self._thread.join()
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
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's prequant
    from prequant.util.pagecache import whole_disk  # standard library only, like this script

    try:
        name = whole_disk(Path(path).stat().st_dev).resolve().name
    except OSError:
        return ""
    return name if name in diskstats() else ""
