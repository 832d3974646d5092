"""check-fsdp: prove a 4-bit checkpoint trains under FSDP+QLoRA, and measure what loading it costs per rank.

Two halves. `check_fsdp()` (behind `prequant check-fsdp`) launches one torchrun job per loader and compares
their reports. The job itself is `prequant.fsdp_job`'s `main()`, run on every rank:

    python -m torch.distributed.run --standalone --nproc_per_node 2 -m prequant.fsdp_job CKPT --loader prequant

Each rank loads the model (transformers' FSDP path, or `load_for_fsdp`), checks that every packed weight's
bytes survived sharding (the shards at rest, gathered; and the unsharded weight bitsandbytes is handed in
forward), then trains a few steps on a fixed random batch (the same batch on every rank, so each step's loss
is the unsharded model's loss). Peak RssAnon/RssFile (sampled from /proc) and peak GPU memory are measured
separately for the load and the training phase.

The transformers path is the one the Hugging Face docs give for QLoRA with FSDP (peft's fsdp_config_qlora.yaml
and the Trainer): `from_pretrained(dtype=bf16)` of the pre-quantized checkpoint with accelerate's FSDP
environment (cpu-ram-efficient loading), peft LoRA on all linear layers, FSDP1 FULL_SHARD with peft's
auto-wrap policy, use_orig_params=False, sync_module_states, BACKWARD_PRE, and mixed precision set to the
quant-storage dtype for params, reductions and buffers (what `update_fsdp_plugin_peft` asks accelerate for).
CPU offload, which the docs turn on for 24 GB GPUs, is left off: it would hide the GPU memory being measured.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .errors import PrequantError, UsageError

LOADERS = ("transformers", "prequant")
BUFFER_DTYPES = ("bfloat16", "float32", "keep")
PACKED_STORAGES = ("uint8", "checkpoint")
GIB = 2**30


# ----------------------------------------------------------------------------------------- launcher side


@dataclass
class CheckReport:
    """The reports of one check-fsdp run, one per loader, and how they compare."""

    checkpoint: str
    nproc: int
    runs: dict[str, dict] = field(default_factory=dict)

    @property
    def comparison(self) -> dict:
        first = {k: r["summary"]["losses"][0] for k, r in self.runs.items() if r.get("summary", {}).get("losses")}
        out: dict[str, Any] = {}
        if len(first) == 2:
            a, b = first.values()
            out = {"first_loss": first, "first_loss_equal": a == b, "first_loss_abs_diff": abs(a - b)}
        return out

    @property
    def ok(self) -> bool:
        runs_ok = bool(self.runs) and all(r.get("summary", {}).get("ok") for r in self.runs.values())
        return runs_ok and self.comparison.get("first_loss_equal", True)

    def to_dict(self) -> dict:
        return {"checkpoint": self.checkpoint, "nproc": self.nproc, "ok": self.ok, "comparison": self.comparison,
                "runs": self.runs}

    def to_text(self) -> str:
        lines = [f"check-fsdp {self.checkpoint} on {self.nproc} ranks"]
        head = f"{'loader':13} {'load s':>7} {'GPU load GiB':>12} {'GPU train GiB':>13} {'RssAnon GiB':>11} " \
               f"{'RssFile GiB':>11} {'bytes intact':>12} {'first loss':>11} {'last loss':>10} {'ok':>4}"
        lines.append(head)
        for loader, r in self.runs.items():
            s = r.get("summary")
            if not s:
                lines.append(f"{loader:13} FAILED: {r.get('error', 'no report')}")
                continue
            losses = s["losses"] or [math.nan]
            lines.append(
                f"{loader:13} {s['load_seconds']:7.1f} {s['peak_gpu_load'] / GIB:12.2f} {s['peak_gpu_train'] / GIB:13.2f} "
                f"{s['peak_rss_anon'] / GIB:11.2f} {s['peak_rss_file'] / GIB:11.2f} "
                f"{'yes' if s['packed_intact'] else 'NO':>12} {losses[0]:11.6f} {losses[-1]:10.6f} "
                f"{'yes' if s['ok'] else 'NO':>4}"
            )
        for loader, r in self.runs.items():
            s = r.get("summary")
            if s:
                lim = s["limits"]
                lines.append(
                    f"{loader}: losses {' '.join(f'{x:.4f}' for x in s['losses'])}; packed {s['packed_tensors']} tensors, "
                    f"{s['nan_patterns']} bf16-NaN patterns, mismatched bytes at rest {s['mismatched_at_rest']}, in "
                    f"forward {s['mismatched_in_forward']}; GPU load limit {lim['gpu_load'] / GIB:.2f} GiB "
                    f"(checkpoint/N + largest layer {lim['largest_layer'] / GIB:.2f} GiB), RssAnon limit "
                    f"{lim['rss_anon'] / GIB:.0f} GiB" + (f"; problems: {'; '.join(s['problems'])}" if s["problems"] else "")
                )
        c = self.comparison
        if c:
            lines.append(f"first-step loss: {'equal' if c['first_loss_equal'] else 'DIFFERENT'} "
                         f"({', '.join(f'{k} {v:.8f}' for k, v in c['first_loss'].items())})")
        lines.append("result: " + ("ok" if self.ok else "FAILED"))
        return "\n".join(lines)


class CheckFailed(PrequantError):
    """check-fsdp ran but a check failed (exit status 1); the full report is on stdout."""

    def __init__(self, report: CheckReport) -> None:
        problems = []
        for loader, run in report.runs.items():
            if "summary" not in run:
                problems.append(f"{loader}: {run.get('error', 'no report')}")
            else:
                problems += [f"{loader}: {p}" for p in run["summary"]["problems"]]
                if run.get("error"):
                    problems.append(f"{loader}: {run['error']}")
        c = report.comparison
        if c and not c["first_loss_equal"]:
            problems.append(f"first-step losses differ by {c['first_loss_abs_diff']:.3g} between the loaders")
        super().__init__("check-fsdp failed: " + "; ".join(problems or ["no run completed"]))


def check_fsdp(
    output_dir: str | Path,
    *,
    nproc: int,
    loaders: tuple[str, ...] | list[str] = LOADERS,
    steps: int = 10,
    seed: int = 0,
    batch_size: int = 2,
    seq_len: int = 256,
    lr: float = 1e-3,
    lora_r: int = 16,
    lora_alpha: int = 32,
    buffer_dtype: str = "bfloat16",
    packed_storage: str = "uint8",
    timeout: float = 1800,
) -> CheckReport:
    """Run the check-fsdp job under torchrun once per loader (in that order) and collect the reports.

    A run that fails or times out is recorded with its error; the others still run. The job's own output
    (progress, per-step losses) goes to stderr."""
    path = Path(output_dir)
    if not (path / "config.json").is_file():
        raise UsageError(f"{path}: no config.json; pass a directory written by prequant convert")
    if nproc < 1:
        raise UsageError(f"--nproc {nproc}: need at least 1 process")
    if torch.cuda.is_available() and nproc > torch.cuda.device_count():
        raise UsageError(f"--nproc {nproc}: only {torch.cuda.device_count()} GPUs here; use at most that many")
    for loader in loaders:
        if loader not in LOADERS:
            raise UsageError(f"--loader {loader!r}: use one of {', '.join(LOADERS)}")
    if buffer_dtype not in BUFFER_DTYPES:
        raise UsageError(f"--buffer-dtype {buffer_dtype!r}: use one of {', '.join(BUFFER_DTYPES)}")
    if packed_storage not in PACKED_STORAGES:
        raise UsageError(f"--packed-storage {packed_storage!r}: use one of {', '.join(PACKED_STORAGES)}")
    if steps < 1:
        raise UsageError(f"--steps {steps}: need at least 1 step")
    report = CheckReport(str(path), nproc)
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(Path(__file__).resolve().parent.parent),
                                                     os.environ.get("PYTHONPATH", "")) if p)}
    for loader in loaders:
        with tempfile.TemporaryDirectory(prefix="prequant-check-fsdp-") as tmp:
            out = Path(tmp) / "report.json"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                   "-m", "prequant.fsdp_job", str(path), "--loader", loader, "--report", str(out),
                   "--steps", str(steps), "--seed", str(seed), "--batch-size", str(batch_size), "--seq-len",
                   str(seq_len), "--lr", str(lr), "--lora-r", str(lora_r), "--lora-alpha", str(lora_alpha),
                   "--buffer-dtype", buffer_dtype, "--packed-storage", packed_storage]
            print(f"check-fsdp: {loader}: {' '.join(cmd[2:])}", file=sys.stderr, flush=True)
            error = _run(cmd, env, timeout)
            if out.is_file():
                report.runs[loader] = json.loads(out.read_text())
                if error:
                    report.runs[loader]["error"] = error
            else:
                report.runs[loader] = {"loader": loader, "error": error or "the job wrote no report"}
    return report


def _run(cmd: list[str], env: dict[str, str], timeout: float) -> str | None:
    """Run torchrun in its own process group (stdout to our stderr); kill the group on timeout."""
    proc = subprocess.Popen(cmd, env=env, stdout=sys.stderr, stderr=sys.stderr, start_new_session=True)
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        return f"timed out after {timeout:.0f} s"
    except KeyboardInterrupt:
        os.killpg(proc.pid, signal.SIGTERM)
        raise
    return f"torchrun exited with status {rc}" if rc else None
