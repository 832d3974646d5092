"""Shard downloads in a child process, so that they do not share the converting process' GIL.

huggingface_hub's download loop takes the GIL for every chunk it writes. In the converting process the
GIL is also taken, call after call, by the CPU kernel's threads, the reader, the writer and the hashing, and
each time the download thread waits for its turn the connection idles. Measured: a streamed conversion on
the GPU machine took shards at 0.40-0.51 GB/s where huggingface_hub alone downloaded 0.64 GB/s from the same
server, and on the 2-core machine one busy Python thread cut a download from 0.17-0.20 to 0.009 GB/s.

`Fetcher` keeps one child (``python -m prequant.hub.fetcher``) that runs `client.download` for each request,
one at a time: a JSON line in, a JSON line out with the path or the pickled error (`PrequantError` crosses
processes with its parts). Settings (HF_ENDPOINT, HF_TOKEN, HF_HUB_OFFLINE, the cache) come with the
environment; huggingface_hub's own output goes to the same stderr. The child ignores SIGINT (the parent
decides how a Ctrl-C ends) and dies with the thread that started it (Linux: PR_SET_PDEATHSIG), so a killed
conversion leaves no download running. Where no child can be started, downloads run in this process.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
from dataclasses import asdict
from pathlib import Path

from ..errors import PrequantError
from . import client

log = logging.getLogger(__name__)

_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])  # the directory holding this prequant
_EXIT_WAIT_S = 2.0  # for an idle child to see its stdin close and exit, before it is killed


class Fetcher:
    """Downloads files of one commit through a child process (started on the first download)."""

    def __init__(self, source: client.HubCommit) -> None:
        self.source = source
        self._proc: subprocess.Popen[str] | None = None
        self._lock = threading.Lock()
        self._in_process = False
        self._busy = False  # a request is in flight
        self._closed = False

    def download(self, filename: str) -> Path:
        """`client.download(source, filename)`, run in the child: its path, or its error raised here."""
        proc = self._child()
        if proc is None:
            return client.download(self.source, filename)
        request = json.dumps({"source": asdict(self.source), "filename": filename})
        self._busy = True
        try:
            assert proc.stdin is not None and proc.stdout is not None
            proc.stdin.write(request + "\n")
            proc.stdin.flush()
            line = proc.stdout.readline()
        except (OSError, ValueError):  # the child is gone, or `close` closed its pipes
            line = ""
        finally:
            self._busy = False
        if not line:
            raise PrequantError(
                f"the download of {filename} of {self.source.repo_id} stopped: its process ended "
                f"(exit status {proc.poll()}); run the command again"
            )
        reply = json.loads(line)
        if "path" in reply:
            return Path(reply["path"])
        raise pickle.loads(base64.b64decode(reply["error"]))

    def close(self) -> None:
        """End the child: at once if it is downloading (the conversion is over), else once it sees EOF."""
        with self._lock:
            proc, self._proc, self._closed = self._proc, None, True
        if proc is None:
            return
        if self._busy:  # a failed or interrupted conversion: its download is not wanted any more
            proc.kill()
        try:
            assert proc.stdin is not None
            proc.stdin.close()
        except OSError:
            pass
        try:
            proc.wait(timeout=_EXIT_WAIT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def _child(self) -> subprocess.Popen[str] | None:
        with self._lock:
            if self._closed:  # the conversion is over: nothing more to fetch, and no child left behind
                raise PrequantError(f"downloads from {self.source.repo_id} were stopped (the conversion ended)")
            if self._proc is None and not self._in_process:
                paths = (_PACKAGE_ROOT, os.environ.get("PYTHONPATH"))  # the child imports this same prequant
                env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
                try:
                    self._proc = subprocess.Popen(
                        [sys.executable, "-m", "prequant.hub.fetcher"], stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE, text=True, env=env,
                    )  # fmt: skip
                except OSError as error:  # e.g. an embedded interpreter without a python executable
                    log.debug("downloading in this process: no child (%s)", error)
                    self._in_process = True
            return self._proc


def _die_with_parent() -> None:
    """Linux: be killed when the thread that started this process ends (the parent's download thread, or the
    whole parent if it is killed); elsewhere nothing: the closed stdin ends this process after its download."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the parent died before the call above
        os._exit(1)


def _serve() -> None:
    """The child: one download per request line, one reply line each, until stdin closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent()
    replies, sys.stdout = sys.stdout, sys.stderr  # whatever a library prints goes to stderr, not into the replies
    for line in sys.stdin:
        request = json.loads(line)
        try:
            path = client.download(client.HubCommit(**request["source"]), request["filename"])
            reply = {"path": str(path)}
        except Exception as error:  # noqa: BLE001 - every failure goes back to the parent, which raises it
            try:
                payload = pickle.dumps(error)
                pickle.loads(payload)  # some exceptions pickle but cannot be rebuilt (their __init__ wants more)
            except Exception:  # noqa: BLE001 - an error that does not cross: its type and text
                payload = pickle.dumps(RuntimeError(f"{type(error).__name__}: {error}"))
            reply = {"error": base64.b64encode(payload).decode()}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


if __name__ == "__main__":
    _serve()
