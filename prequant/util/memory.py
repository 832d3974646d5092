"""How much memory the machine has free (standard library only: the CLI asks before torch is imported)."""

from __future__ import annotations


def available() -> int | None:
    """MemAvailable of /proc/meminfo in bytes, or None where it cannot be read (not Linux, no /proc)."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return None
