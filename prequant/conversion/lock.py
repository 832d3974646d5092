"""One conversion per OUTPUT_DIR at a time: an advisory lock on OUTPUT_DIR/.prequant.lock.

Held from before the first write until the output is published (a resumed run takes it too). The lock is the
kernel's (flock; POSIX record locks where a filesystem has only those, e.g. some NFS setups), so a run killed
by SIGKILL or a crash releases it with its last file descriptor: a stale file never blocks. The file holds who
holds it (pid, host, start time, command line) for the message another run gets, and is removed on release,
so nothing of it ends up in a published output.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

from ..errors import PrequantError

LOCK = ".prequant.lock"
_UNSUPPORTED = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL, errno.EBADF)


class OutputLock:
    """The lock of one OUTPUT_DIR; `acquire()` refuses (PrequantError) when another process holds it."""

    def __init__(self, output_dir: Path) -> None:
        self.output_dir = output_dir
        self.path = output_dir / LOCK
        self._fd: int | None = None

    def acquire(self) -> None:
        while True:
            fd = self._open()
            try:
                if not _lock(fd):
                    holder = _describe(fd)
                    raise PrequantError(
                        f"OUTPUT_DIR {self.output_dir} is in use by another prequant conversion ({holder}); wait for "
                        "it to finish or stop it, or choose another OUTPUT_DIR"
                    )
                # The holder may have released (and removed) the file between our open and our lock: then this
                # inode locks nothing, and the next run would create another. Try again on the current file.
                if _same_file(fd, self.path):
                    break
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)
        record = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                  "command": sys.argv}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)
        self._fd = fd

    def release(self) -> None:
        """Remove the file, then unlock (in that order: a run waiting on this inode then sees it is gone)."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            if _same_file(fd, self.path):
                self.path.unlink(missing_ok=True)
        except OSError:
            pass  # an OUTPUT_DIR that vanished or turned read-only: the lock itself still goes with the fd
        os.close(fd)

    def _open(self) -> int:
        try:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            return os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except PermissionError as e:
            raise PrequantError(f"{self.output_dir}: permission denied ({e.strerror}); choose a writable OUTPUT_DIR") from e
        except OSError as e:
            raise PrequantError(
                f"{self.output_dir}: cannot create the output ({e.strerror}); choose another OUTPUT_DIR"
            ) from e

    def __enter__(self) -> OutputLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _lock(fd: int) -> bool:
    """Take the lock without waiting: False when another process holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError as e:
        if e.errno not in _UNSUPPORTED:
            raise
    try:  # a filesystem without flock: POSIX record locks (NFS's lockd)
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except (BlockingIOError, PermissionError):
        return False
    except OSError as e:
        if e.errno in (errno.EAGAIN, errno.EACCES):
            return False
        if e.errno not in _UNSUPPORTED:
            raise
    print("prequant: warning: this filesystem has no file locks; nothing stops another conversion into the same "
          "OUTPUT_DIR meanwhile", file=sys.stderr)
    return True


def _same_file(fd: int, path: Path) -> bool:
    try:
        st, mine = os.stat(path), os.fstat(fd)
    except FileNotFoundError:
        return False
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def _describe(fd: int) -> str:
    """Who holds the lock, from what it wrote into the file."""
    try:
        record = json.loads(os.pread(fd, 65536, 0) or b"{}")
        pid, host = int(record["pid"]), str(record["host"])
    except (OSError, ValueError, KeyError, TypeError):
        return "a process that is still starting"
    where = "this host" if host == socket.gethostname() else f"host {host}"
    started = f", started {record['started']}" if isinstance(record.get("started"), str) else ""
    return f"pid {pid} on {where}{started}"
