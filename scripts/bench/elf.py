"""What a shared library's ELF headers say, read without loading it (standard library only, like every benchmark
helper here): its sections, where they lie in the file, whether the loader maps them, and the libraries it needs.
`cold_start.py` uses it to tell the bytes a start reads of a library's mapped sections from its GPU code.

Only 64-bit little-endian ELF files are read (every platform torch ships CUDA wheels for); anything else is None.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path

MAGIC = b"\x7fELF"
SHT_NOBITS = 8  # .bss and the like: no bytes in the file
SHF_ALLOC = 0x2  # mapped when the library is loaded (the others, .symtab and debug info, are never read)
DT_NEEDED, DT_RPATH, DT_RUNPATH = 1, 15, 29


@dataclass(frozen=True)
class Section:
    """One section of the file: its name, the bytes [offset, offset + size) it holds in the file, and whether the
    loader maps it (`alloc`)."""

    name: str
    offset: int
    size: int
    alloc: bool


def sections(path: str | os.PathLike) -> list[Section] | None:
    """The sections that hold bytes in the file, in file order; None for a file that is not 64-bit little-endian ELF
    or whose headers do not fit in it."""
    try:
        with open(path, "rb") as f:
            head = f.read(64)
            if len(head) < 64 or head[:4] != MAGIC or head[4] != 2 or head[5] != 1:
                return None
            shoff, = struct.unpack_from("<Q", head, 0x28)
            shentsize, shnum, shstrndx = struct.unpack_from("<HHH", head, 0x3A)
            if not shoff or shentsize < 64 or shstrndx >= shnum:
                return None
            f.seek(shoff)
            table = f.read(shentsize * shnum)
            if len(table) < shentsize * shnum:
                return None
            rows = [struct.unpack_from("<IIQQQQ", table, i * shentsize) for i in range(shnum)]
            _, _, _, _, str_off, str_size = rows[shstrndx]
            f.seek(str_off)
            names = f.read(str_size)
    except OSError:
        return None
    found = []
    for name_at, kind, flags, _addr, offset, size in rows:
        if kind != SHT_NOBITS and size:
            end = names.find(b"\0", name_at)
            name = names[name_at:end if end >= 0 else None].decode("latin-1")
            found.append(Section(name, offset, size, bool(flags & SHF_ALLOC)))
    return sorted(found, key=lambda s: s.offset)


def needed(path: str | os.PathLike) -> tuple[list[str], list[str]] | None:
    """(the sonames the library needs, its run path's folders with $ORIGIN filled in), from its .dynamic section;
    None for a file `sections` cannot read or one without a dynamic section."""
    secs = sections(path)
    if secs is None:
        return None
    by_name = {s.name: s for s in secs}
    dynamic, strings = by_name.get(".dynamic"), by_name.get(".dynstr")
    if dynamic is None or strings is None:
        return None
    try:
        with open(path, "rb") as f:
            f.seek(dynamic.offset)
            entries = f.read(dynamic.size)
            f.seek(strings.offset)
            table = f.read(strings.size)
    except OSError:
        return None

    def text(at: int) -> str:
        end = table.find(b"\0", at)
        return table[at:end if end >= 0 else None].decode("utf-8", "replace")

    names, paths = [], []
    origin = str(Path(path).resolve().parent)
    for i in range(0, len(entries) - 15, 16):
        tag, value = struct.unpack_from("<qQ", entries, i)
        if tag == 0:
            break
        if tag == DT_NEEDED:
            names.append(text(value))
        elif tag in (DT_RPATH, DT_RUNPATH):
            paths += [p.replace("$ORIGIN", origin).replace("${ORIGIN}", origin) for p in text(value).split(":") if p]
    return names, paths
