"""A tensor worker process (``python -m prequant.bnb.tensor_worker FD``): quantizes whole tensors for `tensor_pool`.

Each request (one packet of JSON on the socket FD) names a tensor by where its bytes lie in a source file (path,
offset, device and inode, as the parent mapped it), its dtype and shape, whether it is quantized transposed, the settings, and whether to measure
its error. The worker maps those bytes, runs exactly what the conversion runs in its own process (`Quantizer`
on the CPU, single-threaded, then `stats.entry_stats`), writes the entries into a fresh memfd and sends it back
with their layout (`tensor_wire.encode_entries`). The parent maps that memfd, so the entries cross without a copy.

A failure (NaN in the tensor, a file replaced since it was mapped, anything else) is answered with its message:
the parent redoes that tensor in its own process, which raises the error the user sees. SIGINT and SIGTERM are
ignored: the parent decides how a conversion ends, and a worker ends when its socket closes.
"""

from __future__ import annotations

import json
import mmap
import os
import signal
import socket
import sys
import time

import torch

from ..checkpoint.dtypes import SAFETENSORS_DTYPES
from ..util import pagecache
from . import stats
from .format import Settings
from .kernels import _parallel, _procs
from .quantize import Quantizer
from .tensor_wire import READY, encode_entries

ADVISE = os.environ.get("PREQUANT_WORKER_ADVICE", "1") != "0"


def _mapped(request: dict) -> tuple[mmap.mmap, torch.Tensor]:
    """The request's tensor as a view of its file's pages (copy-on-write, never written), checked to be the file
    the parent mapped."""
    fd = os.open(request["path"], os.O_RDONLY | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != (request["device"], request["inode"]):
            raise OSError(f"{request['path']} was replaced since the conversion mapped it")
        dtype = SAFETENSORS_DTYPES[request["dtype"]]
        nbytes = request["numel"] * dtype.itemsize
        start = request["offset"] - request["offset"] % mmap.ALLOCATIONGRANULARITY
        if request["offset"] + nbytes > st.st_size:
            raise OSError(f"{request['path']} ends before byte {request['offset'] + nbytes}")
        if ADVISE:  # what the read-ahead has not read yet comes in large asynchronous reads, not fault by fault
            pagecache.will_need(fd, request["offset"], nbytes)
        view = mmap.mmap(fd, request["offset"] + nbytes - start, access=mmap.ACCESS_COPY, offset=start)
    finally:
        os.close(fd)
    flat = torch.frombuffer(view, dtype=torch.uint8, count=nbytes, offset=request["offset"] - start)
    return view, flat.view(dtype).view(request["shape"])


def _answer(request: dict, quantizer: Quantizer) -> tuple[dict, int | None]:
    """(reply, memfd of the entries) for one request."""
    view, x = _mapped(request)
    if request["transpose"]:  # a Conv1D weight: quantized as its transpose, read in place (as this process does)
        x = x.t()
    try:
        entries = quantizer(x, request["name"])
        measured = stats.entry_stats(x, entries) if request["stats"] else None
        fd, layout = encode_entries(entries)
    finally:
        del x
        view.close()
    reply = {"entries": layout, "stats": None if measured is None else measured.__dict__}
    return reply, fd


def _serve(fd: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    torch.set_num_threads(1)  # one worker per core: neither torch nor the kernel's pool may add threads here
    _parallel.THREADS, _procs.PROCESSES = 1, 0
    sock = socket.socket(fileno=fd)
    sock.send(READY)
    quantizers: dict[tuple, Quantizer] = {}
    while data := sock.recv(1 << 16):
        request = json.loads(data)
        started = time.perf_counter()
        key = tuple(request["settings"].items())
        quantizer = quantizers.get(key) or quantizers.setdefault(key, Quantizer(Settings(**request["settings"]),
                                                                                 torch.device("cpu")))  # fmt: skip
        try:
            reply, out = _answer(request, quantizer)
        except Exception as e:  # noqa: BLE001 - the parent redoes the tensor, and raises its own error
            reply, out = {"error": f"{type(e).__name__}: {e}"}, None
        reply["seconds"] = time.perf_counter() - started
        body = json.dumps(reply).encode()
        if out is None:
            sock.send(body)
        else:
            socket.send_fds(sock, [body], [out])
            os.close(out)


if __name__ == "__main__":
    sys.stdout = sys.stderr  # whatever a library prints goes to stderr; the socket carries the replies
    _serve(int(sys.argv[1]))
