"""Read the libraries a conversion imports before the source, when they are cold (standard library only: the CLI
starts this before torch is imported).

A process whose libraries are not in the page cache (a fresh machine, a cache dropped) reads them page fault by page
fault: on the GPU machine a tiny conversion's start read 1.27 GB in 2384 files (torch's and CUDA's shared libraries
1.2 GB, 2200 compiled modules 56 MB), and took 5.9-6.8 s to its quantizer against 1.6-2.0 s warm
(`scripts/bench/cold_start.py --device cuda`, 2026-12-04). Beside a conversion's read-ahead each of those small reads
waits behind the source's queued requests: a cold 33 GB Grok-shaped conversion had imported at 10.6-13.1 s and its
quantizer was ready at 18.9-22.7 s, by when the source was nearly read, so the output's writes came after the reads
instead of beside them (1.18x the disk's floor, docs/performance.md run K).

So when torch's main library is found cold, this reads what the start will read first, in big requests on many
threads, and the source's read-ahead starts once it is done (`readahead`):
  - the shared libraries torch's extension loads (the ELF closure of torch/_C from each library's own run path, the
    CUDA libraries torch opens itself, the imported packages' extension modules, bitsandbytes' and triton's for a
    CUDA conversion): only the sections the loader maps, without the GPU code (.nv_fatbin), which CUDA reads kernel
    by kernel and which is most of the bytes of cuBLAS, cuSPARSE and NCCL;
  - the compiled modules (.pyc, where this interpreter keeps them: `sys.pycache_prefix` or __pycache__) of the
    standard library and the packages a conversion imports.
Purely advisory: nothing here fails a conversion. PREQUANT_WARM_LIBRARIES=0 turns it off.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import sysconfig
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from ..util import elf, trace
from ..util.pagecache import advice_chunk, pieces, resident_pages  # noqa: F401 - resident_pages for callers

ENV = "PREQUANT_WARM_LIBRARIES"
# Below this share of libtorch_cpu.so in the page cache, the libraries count as cold (a warm process has touched
# about 55% of it, 236 of its 451 MB on the GPU machine; a dropped cache leaves nearly none).
COLD_FRACTION = 0.2
# What a conversion imports (the CLI, torch and what torch imports, bitsandbytes and, through torch's custom ops,
# torch._dynamo): the packages whose compiled modules a cold start read (`scripts/bench/cold_start.py`).
PACKAGES = ("prequant", "torch", "torchgen", "numpy", "sympy", "mpmath", "triton", "bitsandbytes", "safetensors",
            "typer", "click", "rich", "pygments", "shellingham", "huggingface_hub", "httpx", "httpcore", "h11",
            "anyio", "sniffio", "idna", "certifi", "filelock", "fsspec", "yaml", "tqdm", "packaging",
            "typing_extensions", "opt_einsum", "tabulate", "colorama", "pynvml", "annotated_doc")
# Never imported by a conversion, and large.
STDLIB_SKIP = {"test", "idlelib", "tkinter", "turtledemo", "lib2to3", "ensurepip", "site-packages", "dist-packages",
               "pydoc_data", "config-3"}
# The GPU code of CUDA libraries: CUDA reads the kernels it loads from it, not the loader.
DEVICE_CODE = (".nv_fatbin", "__nv_relfatbin", ".nvFatBinSegment")
# Libraries torch or CUDA open themselves (dlopen), not named in any library's needed list.
OPENED = ("libnvrtc.so", "libnvrtc-builtins.so", "libnvJitLink.so", "libcaffe2_nvrtc.so", "libcudnn.so")
PIECE = 64 * 1024 * 1024  # a mapped range is read in pieces of at most this size, so that threads share a library
THREADS = 16


@dataclass(frozen=True)
class Piece:
    """Bytes [offset, offset + length) of one file, to read."""

    path: str
    offset: int
    length: int


def package_dir(name: str) -> Path | None:
    """Where an import of top-level package `name` would find it, without importing it (None if not installed)."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    return Path(spec.origin) if spec.origin else None


def torch_library() -> Path | None:
    """torch's libtorch_cpu.so, found as an import would find it, without importing torch."""
    torch = package_dir("torch")
    return torch / "lib" / "libtorch_cpu.so" if torch is not None else None


def resident_fraction(path: Path) -> float | None:
    """The share of a file's pages in the page cache (`pagecache.resident_pages`, which reads none of them), or None
    where that cannot be asked."""
    pages = resident_pages(path)
    if not pages:
        return None
    return 1 - pages.count(0) / len(pages)  # only bit 0 (resident) is ever set


def libraries_cold() -> bool:
    """Whether torch's main shared library is mostly outside the page cache (then its imports will read the disk),
    found without importing torch. False when it cannot tell."""
    try:
        lib = torch_library()
        fraction = resident_fraction(lib) if lib is not None and lib.exists() else None
    except Exception:  # noqa: BLE001 - advisory only
        return False
    return fraction is not None and fraction < COLD_FRACTION


def shared_libraries(cuda: bool) -> list[Path]:
    """The shared libraries a conversion's imports load: torch/_C's closure of needed libraries, each looked up in
    the run paths of the libraries that led to it (as the loader does; system libraries, found elsewhere, are left
    out), the libraries CUDA and torch open themselves from those folders, the extension modules of `PACKAGES` and
    the libraries their wheels vendor (numpy.libs), and for a CUDA conversion bitsandbytes' CUDA library and
    triton's (torch._dynamo imports triton)."""
    torch = package_dir("torch")
    if torch is None:
        return []
    roots = sorted(torch.glob("_C*.so"))
    if cuda:
        bnb = package_dir("bitsandbytes")
        if bnb is not None:
            libs = sorted(bnb.glob("libbitsandbytes_cuda*.so"))
            mine = [p for p in libs if p.name == f"libbitsandbytes_cuda{_cuda_version(torch)}.so"]
            roots += mine  # none for a torch built without CUDA
        triton = package_dir("triton")
        roots += sorted(triton.glob("_C/libtriton*.so")) if triton else []
    found: dict[Path, None] = {}
    folders: dict[Path, None] = {torch / "lib": None}
    todo = [(p, [torch / "lib"]) for p in roots]
    while todo:
        path, inherited = todo.pop()
        real = path.resolve()
        if real in found:
            continue
        found[real] = None
        names, run_path = elf.needed(real) or ([], [])
        search = [Path(p) for p in run_path] + inherited
        folders.update(dict.fromkeys(search))
        for name in names:
            hit = next((d / name for d in search if (d / name).is_file()), None)
            if hit is not None:
                todo.append((hit, search))
    for name in PACKAGES:
        where = package_dir(name)
        if where is None or not where.is_dir() or name in ("torch", "triton", "bitsandbytes"):  # (above)
            continue
        vendored = where.parent / f"{name}.libs"
        for hit in [*where.rglob("*.so"), *(vendored.glob("*.so*") if vendored.is_dir() else [])]:
            if hit.is_file():
                found.setdefault(hit.resolve(), None)
    for folder in folders:
        for prefix in OPENED:
            for hit in sorted(folder.glob(prefix + "*")) if folder.is_dir() else []:
                if hit.is_file() and hit.resolve() not in found:
                    found[hit.resolve()] = None
    return list(found)


def _cuda_version(torch: Path) -> str:
    """The CUDA version torch was built for as bitsandbytes names its libraries ('130' for 13.0; BNB_CUDA_VERSION
    wins, as in bitsandbytes), read from torch/version.py without importing torch; '' when unknown."""
    if os.environ.get("BNB_CUDA_VERSION"):
        return os.environ["BNB_CUDA_VERSION"]
    try:
        text = (torch / "version.py").read_text()
    except OSError:
        return ""
    for line in text.splitlines():
        if line.startswith("cuda") and "=" in line:
            value = line.split("=", 1)[1].strip().strip("'\"")
            return value.replace(".", "") if value[:1].isdigit() else ""
    return ""


def compiled_modules() -> list[Path]:
    """The compiled modules (.pyc) this interpreter would read for the standard library and `PACKAGES`."""
    folders = [p for p in (package_dir(n) for n in PACKAGES) if p is not None]
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    out: list[Path] = []
    for folder in [stdlib, *folders]:
        if folder.is_file():  # a single-module package (typing_extensions.py)
            out.append(Path(importlib.util.cache_from_source(str(folder))))
            continue
        for dirpath, dirs, names in os.walk(folder):
            if folder == stdlib:
                dirs[:] = [d for d in dirs if d not in STDLIB_SKIP and not d.startswith("config-")]
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            out += [Path(importlib.util.cache_from_source(os.path.join(dirpath, n))) for n in names if n.endswith(".py")]
    return out


def mapped_ranges(path: Path) -> list[tuple[int, int]]:
    """(offset, bytes) of the file's sections the loader maps, GPU code left out, adjacent ones merged; the whole
    file where its sections cannot be read."""
    secs = elf.sections(path)
    if secs is None:
        return [(0, path.stat().st_size)]
    ranges: list[tuple[int, int]] = []
    for s in secs:
        if not s.alloc or s.name in DEVICE_CODE:
            continue
        if ranges and s.offset <= ranges[-1][0] + ranges[-1][1] + 4096:
            start = ranges[-1][0]
            ranges[-1] = (start, max(ranges[-1][1], s.offset + s.size - start))
        else:
            ranges.append((s.offset, s.size))
    return ranges


def plan(cuda: bool) -> list[Piece]:
    """What to read: the shared libraries' mapped ranges in pieces of at most PIECE, then the compiled modules."""
    out: list[Piece] = []
    for lib in shared_libraries(cuda):
        for offset, length in mapped_ranges(lib):
            out += [Piece(str(lib), start, n) for start, n in pieces(offset, length, PIECE)]
    out += [Piece(str(p), 0, -1) for p in compiled_modules()]
    return out


def read(todo: list[Piece], threads: int = THREADS) -> int:
    """Read the pieces into the page cache on `threads` threads, largest first; the bytes read. A piece of length -1
    is a whole small file, read; a range is asked for in the pieces Linux reads whole (`posix_fadvise(WILLNEED)`),
    then waited for."""
    def one(piece: Piece) -> int:
        try:
            fd = os.open(piece.path, os.O_RDONLY)
        except OSError:
            return 0  # a module never compiled, a file gone: nothing to read
        try:
            if piece.length < 0:
                return sum(len(b) for b in iter(lambda: os.read(fd, 1 << 20), b""))
            ends = []
            for start, n in pieces(piece.offset, piece.length, advice_chunk(fd)):
                os.posix_fadvise(fd, start, n, os.POSIX_FADV_WILLNEED)
                ends.append(start + n)
            for end in ends:  # reading a piece's last byte waits for that piece's read
                os.pread(fd, 1, end - 1)
            return piece.length
        except OSError:
            return 0
        finally:
            os.close(fd)

    with ThreadPoolExecutor(max(1, threads), thread_name_prefix="prequant-libraries") as pool:
        return sum(pool.map(one, sorted(todo, key=lambda p: -p.length)))


class Warming:
    """The read of the libraries, on a thread of its own: `done` once over, `completed` if nothing stopped it."""

    def __init__(self, cuda: bool) -> None:
        self.done = threading.Event()
        self.completed = False
        self.seconds = 0.0
        self.bytes = 0
        self._thread = threading.Thread(target=self._run, args=(cuda,), name="prequant-libraries", daemon=True)
        self._thread.start()

    def _run(self, cuda: bool) -> None:
        start = time.monotonic()
        try:
            self.bytes = read(plan(cuda))
            self.completed = True
        except Exception:  # noqa: BLE001 - advisory only
            pass
        finally:
            self.seconds = time.monotonic() - start
            trace.mark("libraries-read")
            self.done.set()


_current: Warming | None = None
_found_cold = False  # whether this process found its libraries cold


def start(device: str) -> None:
    """From the CLI, before torch is imported: if the libraries are cold, start reading them (`device` as the user
    named it: 'cpu' leaves out the CUDA-only libraries). Does nothing with PREQUANT_WARM_LIBRARIES=0."""
    global _current, _found_cold
    if _current is not None or not hasattr(os, "posix_fadvise") or not libraries_cold():
        return
    _found_cold = True
    if os.environ.get(ENV, "1").strip() != "0":
        _current = Warming(cuda=device != "cpu")


def wait(timeout: float | None = None) -> None:
    """Wait for the read of the libraries, if one was started (the source's read-ahead goes after it)."""
    if _current is not None:
        _current.done.wait(timeout)


def check_cold() -> bool:
    """Where no start-up check was made (`start`), make it now and remember it; then `still_cold`."""
    global _found_cold
    if _current is None and not _found_cold and libraries_cold():
        _found_cold = True
    return still_cold()


def still_cold() -> bool:
    """Whether this process found its libraries cold and has not read them since: CUDA's start would then fault
    them in behind the pipeline's reads and writes (`conversion.run` waits for it instead)."""
    return _found_cold and not (_current is not None and _current.completed)


def found_cold() -> bool:
    """Whether this process found its libraries cold at its start (read since or not)."""
    return _found_cold


def _reset() -> None:
    """Forget this process' check (tests)."""
    global _current, _found_cold
    _current, _found_cold = None, False


if __name__ == "__main__":  # what a cold start would read: python -m prequant.conversion.libraries [cpu]
    todo = plan(cuda=sys.argv[1:2] != ["cpu"])
    libs = {p.path for p in todo if p.length >= 0}
    print(f"{len(libs)} shared libraries, {sum(p.length for p in todo if p.length >= 0) / 1e6:.1f} MB mapped; "
          f"{sum(1 for p in todo if p.length < 0)} compiled modules")
