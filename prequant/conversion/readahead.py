"""Keep the disk busy: read the source into the page cache ahead of the pipeline, in the background.

A conversion is bound by the disk. Two things would leave it idle: the few seconds a cold process
spends importing torch, CUDA and transformers, and the gaps between the pipeline's own reads. So the
CLI starts this before any heavy import (standard library only), and it keeps asking the kernel
(`posix_fadvise(WILLNEED)`, asynchronous) for the next bytes of the weight files in file order, the
order the pipeline reads them, staying at most a window ahead of what the pipeline has consumed. The
window bounds page-cache use, which is reclaimable anyway, never anonymous memory. Purely advisory:
any problem here is ignored; the real checks happen in `source` and `checkpoint`.

It also bounds how much it has asked of the disk and not yet received (`depth`). Unbounded, the advice
fills the device's whole request queue (256 requests of up to 4 MiB on the GPU machine's virtio disk, about
a gigabyte), and any other read, such as a library page the imports fault in, waits behind all of it:
on the GPU machine the start-up (imports, bitsandbytes, CUDA) took 10 s instead of 4 s beside it. The
depth is shallow while the processes start up (32 MiB still reads a cold 16 GB as fast as no bound does,
8.5 against 8.35 s), then deeper once the pipeline runs (128 MiB): its shard writes share the queue, and
with 32 MiB they starved the reads (the 16 GB pipeline took 7.2 s instead of 4.9 s).

On the CPU, once the pipeline runs, the window shrinks to a lead over what the pipeline has written
(`pipeline_window`). Left at a quarter of the memory, the read-ahead reads the whole source first while the shard
writes wait behind those reads (in sync_file_range: 17.7 s of a cold Grok-shaped 33 GB's 32.1 s on the GPU machine),
and what is left once the source is read is every tensor not yet quantized. On the CPU that is the slow part, so a
lead of 2 GB keeps the quantizing beside the reads. On a GPU what is left is only writes, and a bounded lead made
the pipeline's own reads wait for the disk instead (18.6 s of reading against 2.0 s), so there the window stays as
it was. One run each on the GPU machine (`scripts/bench/window.py`, 2026-12-02; floors: 16 GB Llama 11.0 s,
measured on the same machine a minute later; Grok shapes 22.6 s):

    lead           Llama --device cpu   Llama --device cuda   Grok cuda, all cold
    2 GB              14.6 s (1.32x)       15.1 s (1.37x)        28.2 s (1.25x)
    1 GB              14.7 s (1.33x)       13.4 s (1.22x)             -
    the start-up's    15.5 s (1.40x)       13.5 s (1.22x)        26.0 s (1.15x)

When the libraries themselves are cold (not in the page cache: a fresh machine, a cache dropped), the imports
read them page fault by page fault, each fault a small read that waits behind whatever the readahead has
queued: on the GPU machine a cold Grok-shaped 33 GB conversion finished importing at 22.4 s with 32 MiB of
queued advice, where a cold tiny conversion, with nothing read ahead, had imported at 3.2 s (2026-12-01,
`scripts/bench/convert.py --size-gb 33 --shape grok --device cuda`, and a tiny checkpoint). So the CLI checks whether
torch's main library is in the page cache (`libraries_cold`) and, if not, starts at `COLD_START_DEPTH`. Measured
then, 1 MiB was best (one lease, 2026-12-02, floors 24.8-25.5 s: 33.3 s against 34.6 s at 4 MiB and 40.5 s asking
nothing; `scripts/bench/convert.py --size-gb 33 --shape grok --device cuda`, the depth set by PREQUANT_READAHEAD_COLD_DEPTH).

Now a conversion whose libraries are cold has the pipeline wait for CUDA (`conversion.run`), and the read-ahead reads
the whole source during that start-up. The deeper the queue, the slower the start-up, but the disk then reads at its
full speed meanwhile, and the run is bound by the disk, not by the start-up. Two runs each, interleaved, one lease
(2026-12-02 21:05 UTC, `scripts/bench/window.py --size-gb 33 --shape grok --devices cuda --windows 0 --env
PREQUANT_READAHEAD_COLD_DEPTH=1048576,4194304,8388608,16777216 --repeats 2`; floor 21.1 s, cold read 16.9 s):

    depth while cold    quantizer ready   read-ahead done   whole run
    1 MiB                 6.8 / 4.0 s      23.8 / 22.3 s     26.4 / 24.5 s (1.25x / 1.16x)
    4 MiB                 6.8 / 5.9 s      21.2 / 20.7 s     23.9 / 23.8 s (1.13x / 1.12x)
    8 MiB                 9.3 / 8.4 s      20.0 / 20.3 s     23.9 / 24.6 s (1.13x / 1.16x)
    16 MiB               16.0 / 16.7 s     16.9 / 17.0 s     23.5 / 23.4 s (1.11x / 1.11x), the default

At 16 MiB the source is read as fast as `cat` reads it (17.0 against 16.9 s), then only the writes are left: 9.3 GB
in 6.1 s, the writer thread busy 92% of it, the disk 34-97% busy by the second. What is left is the writer's, not
the disk's.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from pathlib import Path

from ..util import memory, trace
from ..util.pagecache import advice_chunk, pieces, resident_pages

_STEP = 64 * 1024 * 1024
# Bytes asked of the disk and not yet read: enough to keep it streaming, little for other reads to wait behind.
START_DEPTH = 32 * 1024 * 1024  # while torch, bitsandbytes, CUDA and transformers load
PIPELINE_DEPTH = 128 * 1024 * 1024  # once the pipeline reads and writes too
# While cold libraries are faulted in (module docstring). PREQUANT_READAHEAD_COLD_DEPTH (bytes; 0 asks nothing
# until the pipeline starts) overrides it, for `scripts/bench/convert.py` to compare depths on a machine.
COLD_START_DEPTH = 16 * 1024 * 1024
COLD_ENV = "PREQUANT_READAHEAD_COLD_DEPTH"
# How far the read-ahead may lead the writer once the pipeline runs, by where it quantizes (module docstring); a
# device not named keeps the start-up's window. PREQUANT_READAHEAD_WINDOW (bytes; 0: the start-up's window) overrides
# it, for `scripts/bench/window.py` to compare leads.
PIPELINE_WINDOW = {"cpu": 2 * 10**9}
WINDOW_ENV = "PREQUANT_READAHEAD_WINDOW"
# Below this share of libtorch_cpu.so in the page cache, the libraries count as cold (a warm process has touched
# about 55% of it, 236 of its 451 MB on the GPU machine; a dropped cache leaves nearly none).
COLD_FRACTION = 0.2


def default_window() -> int:
    """A quarter of the memory available (to this container, when its cgroup has a limit). Page cache, not
    process memory: the kernel reclaims it under pressure. It is large on purpose: a cold process spends
    seconds importing torch, transformers and bitsandbytes, and whatever the disk reads meanwhile is what
    the pipeline then gets at memory speed. Past the container's limit, it would evict the pages just read."""
    avail = memory.available()
    if avail is None:
        return 2 * 10**9
    room = _cgroup_room()
    return max(_STEP, min(avail, room if room is not None else avail) // 4)


def pipeline_window(device_type: str) -> int:
    """The most bytes the read-ahead leads the pipeline's writes by once the pipeline runs, for a conversion that
    quantizes on `device_type` ('cpu', 'cuda'): PIPELINE_WINDOW's, or PREQUANT_READAHEAD_WINDOW's bytes; 0 or none
    is the start-up's `default_window`, and it is never more than that."""
    start_up = default_window()
    default = PIPELINE_WINDOW.get(device_type, 0)
    try:
        asked = int(os.environ.get(WINDOW_ENV, default))
    except ValueError:
        asked = default
    return start_up if asked <= 0 else max(_STEP, min(asked, start_up))


def _cgroup_room(proc: Path = Path("/proc/self/cgroup"), root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Bytes this process' cgroup (v2) may still use before its memory limit, or None without a limit."""
    try:
        lines = proc.read_text().splitlines()
        rel = next(line[3:] for line in lines if line.startswith("0::"))
        group = root / rel.lstrip("/")
        limit = (group / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return max(0, int(limit) - int((group / "memory.current").read_text()))
    except (OSError, StopIteration, ValueError):
        return None


class Readahead:
    """A background thread that keeps up to `window` bytes of the source read ahead of `consumed`."""

    def __init__(self, files: list[Path], window: int | None = None, depth: int = PIPELINE_DEPTH,
                 cold_depth: int | None = None) -> None:
        self.files = [Path(f) for f in files]
        self.window = window or default_window()
        self.depth = depth
        # `cold_depth`: the depth while the libraries load, if this thread finds them cold (`libraries_cold`),
        # unless a depth is set first.
        self._cold_depth = cold_depth
        self._consumed = 0
        self._cond = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="prequant-readahead", daemon=True)
        self._thread.start()

    def consumed(self, nbytes: int) -> None:
        """The pipeline has finished with `nbytes` more of the source, in file order."""
        with self._cond:
            self._consumed += nbytes
            self._cond.notify()

    def set_window(self, window: int) -> None:
        """From now on, stay at most `window` bytes ahead of what the pipeline has consumed."""
        with self._cond:
            self.window = window
            self._cond.notify()

    def set_depth(self, depth: int) -> None:
        """From the next request on, keep at most `depth` bytes asked of the disk and not yet read (0: ask
        nothing until a later call sets a depth)."""
        with self._cond:
            self.depth = depth
            self._cold_depth = None  # a depth set now wins over what the start-up check finds
            self._cond.notify()

    def stop(self) -> None:
        global _current
        with self._cond:
            self._stopped = True
            self._cond.notify()
        if _current is self:
            _current = None  # the next conversion in this process starts a fresh one

    def _run(self) -> None:
        global _found_cold
        if self._cold_depth is not None and libraries_cold():
            _found_cold = True
            with self._cond:
                if self._cold_depth is not None:
                    self.depth = self._cold_depth
        position = 0
        asked: deque[tuple[int, int]] = deque()  # (end offset, bytes) of advice not yet known to be read
        try:
            for file in self.files:
                fd = os.open(file, os.O_RDONLY)
                try:
                    size = os.fstat(fd).st_size
                    chunk = advice_chunk(fd)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
                    for offset in range(0, size, _STEP):
                        n = min(_STEP, size - offset)
                        with self._cond:
                            self._cond.wait_for(lambda: self._stopped or (
                                self.depth > 0 and position - self._consumed < self.window))
                            if self._stopped:
                                return
                            behind = position + n <= self._consumed  # done already (e.g. before a --resume)
                        if not behind:
                            for start, piece in pieces(offset, n, min(chunk, self.depth) or chunk):
                                _wait_read(fd, asked, self.depth - piece)  # depth read afresh: set_depth
                                os.posix_fadvise(fd, start, piece, os.POSIX_FADV_WILLNEED)
                                asked.append((start + piece, piece))
                        position += n
                    _wait_read(fd, asked, 0)  # before this file's descriptor closes
                finally:
                    os.close(fd)
            trace.mark("read-ahead-done")
        except Exception:  # noqa: BLE001 - advisory only
            pass


def _wait_read(fd: int, asked: deque[tuple[int, int]], limit: int) -> None:
    """Wait, oldest first, until at most `limit` bytes of advice are still being read. Reading a piece's last
    byte waits for that page's I/O, which the disk completes about when the rest of the piece."""
    while asked and sum(n for _, n in asked) > limit:
        end, _ = asked.popleft()
        os.pread(fd, 1, end - 1)


_current: Readahead | None = None
_found_cold = False  # whether a start-up read-ahead of this process found the libraries cold


def found_libraries_cold() -> bool:
    """Whether this process started cold: the CLI's start-up read-ahead found torch's library outside the page
    cache before torch was imported (`libraries_cold`). False where nothing checked (a library caller)."""
    return _found_cold


def note_cold_start() -> bool:
    """From the CLI, before torch is imported, for a source no start-up read-ahead checks (a Hub repo): whether the
    libraries are cold (`libraries_cold`), remembered for `found_libraries_cold`. A Hub shard downloaded at the
    link's speed is there before CUDA is: with the CPU quantizing it meanwhile, CUDA's cold start took 10.3 s where
    it took 4.7 s in a run whose first shard came after it (a 33 GB Grok-shaped repo from the local Hub,
    `scripts/bench/hub_scale.py`, the GPU machine, 2026-12-04), and the two-shard bound held the third download
    back until the first shard was converted."""
    global _found_cold
    _found_cold = _found_cold or libraries_cold()
    return _found_cold


def start(files: list[Path], depth: int = PIPELINE_DEPTH, cold_depth: int | None = None,
          window: int | None = None) -> Readahead | None:  # fmt: skip
    """Start (or keep, if already started on the same files) the process' readahead, at this depth and, if given,
    window; a new one started with `cold_depth` uses that instead while the libraries are cold (`Readahead`)."""
    global _current
    if not hasattr(os, "posix_fadvise"):
        return None
    files = [Path(f) for f in files]
    if _current is None or _current.files != files:
        if _current is not None:
            _current.stop()
        _current = Readahead(files, window=window, depth=depth, cold_depth=cold_depth)
    else:
        _current.set_depth(depth)
        if window is not None:
            _current.set_window(window)
    return _current


def start_for_source(source: str) -> int:
    """From the CLI, before torch is imported: the weight files of a local checkpoint directory. (Not for a
    dry run, which reads headers only, nor a resume, whose finished part convert() reports before it starts.)
    Returns their bytes (0 for anything else), for the CLI to decide what else to start early."""
    from ..source.spec import local  # standard library only, like this module

    try:
        path = Path(source)
        if path.is_dir():
            files = list(local(source, path).weight_files)
            start(files, depth=START_DEPTH, cold_depth=cold_start_depth())
            return sum(f.stat().st_size for f in files)
    except Exception:  # noqa: BLE001 - advisory only; convert() reports any problem properly
        pass
    return 0


def cold_start_depth() -> int:
    """The start-up depth beside cold libraries: COLD_START_DEPTH, or the bytes PREQUANT_READAHEAD_COLD_DEPTH says."""
    try:
        return max(0, int(os.environ.get(COLD_ENV, COLD_START_DEPTH)))
    except ValueError:
        return COLD_START_DEPTH


def libraries_cold() -> bool:
    """Whether torch's main shared library is mostly outside the page cache (then its imports will read the disk),
    found without importing torch. False when it cannot tell."""
    try:
        lib = _torch_library()
        fraction = resident_fraction(lib) if lib is not None else None
    except Exception:  # noqa: BLE001 - advisory only, like the read-ahead itself: then keep the usual depth
        return False
    return fraction is not None and fraction < COLD_FRACTION


def _torch_library() -> Path | None:
    """torch's libtorch_cpu.so, found as an import would find it, without importing torch."""
    import importlib.util

    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / "lib" / "libtorch_cpu.so"


def resident_fraction(path: Path) -> float | None:
    """The share of a file's pages in the page cache (`pagecache.resident_pages`, which reads none of them), or None
    where that cannot be asked."""
    pages = resident_pages(path)
    if not pages:
        return None
    return 1 - pages.count(0) / len(pages)  # only bit 0 (resident) is ever set
