"""Decide the layout (`bnb.layout.analyze`) in a child process, while this one imports torch and CUDA.

Deciding which tensors become 4-bit builds the model on the meta device with transformers, and importing
transformers' modeling code costs several seconds of one core (4-5 s on the GPU machine, warm), more than
torch, bitsandbytes and CUDA initialisation together. Done in turn, they are the longest stretch before the
first tensor is read. So the CLI starts this child first thing, before torch is imported (standard library
only here), and `convert()` takes the child's answer when it is the answer to the same question: the same
source tensors (names and shapes), skip list and trust setting. Anything else (a Hub source, the library
called directly, a child that failed or disagrees) and `convert()` decides in-process, as before: the child
only ever saves time, it never changes a decision or an error message.

It needs spare cores: both processes import torch at the same time. On the 2-core CPU machine the child
made planning 2 s slower (7.7 s -> 9.8 s to "planned", `scripts/bench/convert.py --device cpu`), so the CLI only
starts it where there are at least `MIN_CPUS` (the GPU machine has 16).
"""

from __future__ import annotations

import atexit
import base64
import hashlib
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ..bnb.predict import may_settle

if TYPE_CHECKING:
    from ..bnb.layout import Layout
    from ..checkpoint.tensors import TensorRef

MIN_CPUS = 4
_child: tuple[subprocess.Popen, dict] | None = None


def worthwhile() -> bool:
    """Enough cores for the child to run beside this process' own imports."""
    try:
        return len(os.sched_getaffinity(0)) >= MIN_CPUS
    except AttributeError:  # not Linux
        return (os.cpu_count() or 1) >= MIN_CPUS


def tensors_key(tensors: list[TensorRef]) -> str:
    """What the layout depends on from the checkpoint: every tensor's name and shape, in order."""
    names = json.dumps([[t.name, list(t.shape)] for t in tensors], separators=(",", ":"))
    return hashlib.sha256(names.encode()).hexdigest()


def start(source: str, skip: list[str], trust_remote_code: bool) -> None:
    """From the CLI, before torch is imported: decide the layout of a local checkpoint in a child process."""
    global _child
    try:
        path = Path(source).expanduser()
        if not (path / "config.json").is_file():
            return  # a Hub repo or alias, or a bad path: convert() handles it (and reports any problem)
        if may_settle(json.loads((path / "config.json").read_text())):
            return  # the layout will most likely be known from names (else convert() decides in-process)
        request = {"source": str(path.resolve()), "skip": list(skip), "trust_remote_code": bool(trust_remote_code)}
        package_parent = str(Path(__file__).resolve().parents[2])  # the child imports this very prequant
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [package_parent, os.environ.get("PYTHONPATH")]))}
        env.pop("PREQUANT_TRACE", None)  # the trace is this process' timeline
        proc = subprocess.Popen(
            [sys.executable, "-m", "prequant.conversion.layout_worker", json.dumps(request)],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
        )
    except Exception:  # noqa: BLE001 - only an optimisation: convert() decides in-process
        return
    _child = (proc, request)
    atexit.register(_stop)


def take(source_dir: Path, tensors: list[TensorRef], skip: list[str], trust_remote_code: bool) -> Layout | None:
    """The child's layout when it answers exactly this question, else None (then decide in-process)."""
    global _child
    if _child is None:
        return None
    proc, request = _child
    _child = None
    if request != {"source": str(Path(source_dir).resolve()), "skip": list(skip),
                   "trust_remote_code": bool(trust_remote_code)}:
        _kill(proc)
        return None
    try:
        out, err = proc.communicate()
        answer = json.loads(out)
    except (OSError, ValueError):
        return None
    if proc.returncode != 0 or answer.get("tensors_key") != tensors_key(tensors):
        return None
    if err:
        sys.stderr.write(err.decode(errors="replace"))  # what transformers said while building the model
    if "error" in answer:  # the same refusal the parent would come to (e.g. a shape the model contradicts)
        raise pickle.loads(base64.b64decode(answer["error"]))
    return _layout_from_dict(answer["layout"])


def drop() -> None:
    """End the child without its answer (the layout is known without it)."""
    global _child
    if _child is not None:
        _kill(_child[0])
        _child = None


def _stop() -> None:
    if _child is not None:
        _kill(_child[0])


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.communicate()


def _layout_to_dict(layout: Layout) -> dict:
    return {
        "decisions": {
            name: [d.quantize, d.reason, d.transpose, d.dtype, d.fused] for name, d in layout.decisions.items()
        },
        "skip_modules": layout.skip_modules,
        "method": layout.method,
        "notes": layout.notes,
        "warnings": layout.warnings,
    }


def _layout_from_dict(data: dict) -> Layout:
    from ..bnb.layout import Decision, Layout

    decisions = {name: Decision(bool(q), str(reason), bool(t), dtype, bool(f))
                 for name, (q, reason, t, dtype, f) in data["decisions"].items()}
    return Layout(decisions, data["skip_modules"], data["method"], list(data["notes"]), list(data["warnings"]))


def main() -> None:
    """The child: scan the local checkpoint, decide, print the layout as JSON on stdout."""
    from ..bnb.layout import analyze
    from ..source.spec import local
    from ..source.resolve import contents

    from ..errors import PrequantError

    request = json.loads(sys.argv[1])
    src = local(request["source"], Path(request["source"]))
    held = contents(src)  # as the parent sees it (an FP8 source: its 16-bit tensors)
    tensors = held.tensors
    try:
        layout = analyze(held.config, src.path, tensors, request["skip"], request["trust_remote_code"])
    except PrequantError as e:  # carried to the parent, which raises it as it would have raised it itself
        json.dump({"tensors_key": tensors_key(tensors), "error": base64.b64encode(pickle.dumps(e)).decode()}, sys.stdout)
        return
    json.dump({"tensors_key": tensors_key(tensors), "layout": _layout_to_dict(layout)}, sys.stdout)


if __name__ == "__main__":
    main()
