"""Reading cold libraries first: which files a conversion's start reads (ELF closure, mapped sections, compiled
modules), and that reading them puts them in the page cache."""

from __future__ import annotations

import importlib.util
import os
import struct
from pathlib import Path

import pytest

import prequant.cli
from prequant.conversion import libraries
from prequant.util import elf

TORCH = libraries.package_dir("torch")


def _evict(path: Path) -> None:
    """Flushed and dropped from the page cache (as after `echo 3 > drop_caches`), where the file system lets it."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def test_elf_sections_and_needed_libraries_of_torch_cpu():
    lib = TORCH / "lib" / "libtorch_cpu.so"
    secs = elf.sections(lib)
    by_name = {s.name: s for s in secs}
    assert by_name[".text"].alloc and by_name[".dynsym"].alloc
    assert all(s.offset + s.size <= lib.stat().st_size for s in secs)
    assert [s.offset for s in secs] == sorted(s.offset for s in secs)
    if ".symtab" in by_name:  # not stripped: the symbol table is never mapped
        assert not by_name[".symtab"].alloc
    names, run_path = elf.needed(lib)
    assert "libc10.so" in names and any(Path(p).resolve() == (TORCH / "lib").resolve() for p in run_path)


def test_elf_refuses_what_is_not_a_64_bit_little_endian_elf(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("not a library")
    short = tmp_path / "short.so"
    short.write_bytes(b"\x7fELF\x02\x01" + b"\0" * 10)
    big_endian = tmp_path / "be.so"
    big_endian.write_bytes(b"\x7fELF\x02\x02" + b"\0" * 100)
    bad_table = tmp_path / "bad.so"
    head = bytearray(b"\x7fELF\x02\x01" + b"\0" * 58)
    struct.pack_into("<Q", head, 0x28, 10**9)  # section headers far past the end
    struct.pack_into("<HHH", head, 0x3A, 64, 3, 1)
    bad_table.write_bytes(bytes(head))
    for f in (text, short, big_endian, bad_table, tmp_path / "missing.so"):
        assert elf.sections(f) is None and elf.needed(f) is None


def test_the_shared_libraries_are_torch_s_closure_from_its_extension():
    libs = libraries.shared_libraries(cuda=False)
    names = {p.name for p in libs}
    assert {"libtorch_cpu.so", "libc10.so", "libtorch_python.so"} <= names
    assert any(n.startswith("_C") for n in names)
    assert len(libs) == len(set(libs)) and all(p.is_file() for p in libs)
    # Only what the libraries' own run paths lead to: the system's C library is not read again.
    assert not any(n.startswith("libc.so") for n in names)


def test_mapped_ranges_leave_out_what_the_loader_never_reads():
    lib = TORCH / "lib" / "libtorch_cpu.so"
    ranges = libraries.mapped_ranges(lib)
    text = next(s for s in elf.sections(lib) if s.name == ".text")
    assert any(o <= text.offset and text.offset + text.size <= o + n for o, n in ranges)
    assert all(a[0] + a[1] < b[0] for a, b in zip(ranges, ranges[1:]))  # merged, in order
    assert sum(n for _, n in ranges) <= lib.stat().st_size


def test_the_compiled_modules_include_the_cli_s_and_torch_s_where_this_interpreter_keeps_them():
    modules = set(libraries.compiled_modules())
    assert Path(importlib.util.cache_from_source(prequant.cli.__file__)) in modules
    assert Path(importlib.util.cache_from_source(str(TORCH / "__init__.py"))) in modules
    assert Path(importlib.util.cache_from_source(os.__file__)) in modules  # the standard library's


def test_the_plan_reads_the_libraries_in_pieces_then_the_modules():
    todo = libraries.plan(cuda=False)
    ranges = [p for p in todo if p.length >= 0]
    assert ranges and all(0 < p.length <= libraries.PIECE for p in ranges)
    assert any(p.length < 0 for p in todo)
    lib = str((TORCH / "lib" / "libtorch_cpu.so").resolve())
    assert sum(p.length for p in ranges if p.path == lib) == sum(n for _, n in libraries.mapped_ranges(Path(lib)))


def test_reading_a_library_s_pieces_puts_its_mapped_sections_in_the_page_cache(tmp_path):
    lib = tmp_path / "libc10.so"  # a copy: this process maps torch's own, whose pages cannot be dropped
    lib.write_bytes((TORCH / "lib" / "libc10.so").read_bytes())
    _evict(lib)
    before = libraries.resident_fraction(lib)
    if before is None or before > 0.5:
        pytest.skip(f"this file system keeps pages DONTNEED asks to drop (resident {before})")
    ranges = libraries.mapped_ranges(lib)
    todo = [libraries.Piece(str(lib), o, n) for o, n in ranges]
    small = tmp_path / "module.pyc"
    small.write_bytes(b"\1" * 5000)
    n = libraries.read([*todo, libraries.Piece(str(small), 0, -1), libraries.Piece(str(tmp_path / "gone.pyc"), 0, -1)])
    assert n == sum(p.length for p in todo) + 5000  # a module never compiled counts nothing, and fails nothing
    pages = libraries.resident_pages(lib)
    mapped = {i for o, length in ranges for i in range(o // 4096, (o + length - 1) // 4096 + 1)}
    assert sum(pages[i] & 1 for i in mapped) >= 0.9 * len(mapped)


def test_start_reads_only_when_cold_and_not_turned_off(tmp_path, monkeypatch):
    monkeypatch.setattr(libraries, "_found_cold", False)
    monkeypatch.setattr(libraries, "_current", None)
    warm = tmp_path / "warm.so"
    warm.write_bytes(b"\1" * (1 << 20))  # just written: in the page cache
    monkeypatch.setattr(libraries, "torch_library", lambda: warm)
    libraries.start("cuda")
    assert libraries._current is None and not libraries.found_cold() and not libraries.still_cold()

    cold = tmp_path / "cold.so"
    cold.write_bytes(os.urandom(8 << 20))
    _evict(cold)
    fraction = libraries.resident_fraction(cold)
    if fraction is None or fraction > libraries.COLD_FRACTION:
        pytest.skip("this file system keeps pages DONTNEED asks to drop")
    monkeypatch.setattr(libraries, "torch_library", lambda: cold)
    monkeypatch.setenv(libraries.ENV, "0")
    libraries.start("cuda")
    assert libraries._current is None and libraries.found_cold() and libraries.still_cold()  # cold, and left so

    monkeypatch.setattr(libraries, "_found_cold", False)
    monkeypatch.delenv(libraries.ENV)
    libraries.start("cpu")
    warming = libraries._current
    assert warming is not None and libraries.found_cold()
    libraries.wait()
    assert warming.completed and warming.bytes > 0 and not libraries.still_cold()
