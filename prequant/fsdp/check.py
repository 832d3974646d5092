"""check-fsdp: prove a 4-bit checkpoint trains under FSDP+QLoRA, and measure what loading it costs per rank.

Two halves. `check_fsdp()` (behind `prequant check-fsdp`) launches one torchrun job per loader and compares
their reports. The job itself is `prequant.fsdp.job`'s `main()`, run on every rank with one JSON request:

    python -m torch.distributed.run --standalone --nproc_per_node 2 -m prequant.fsdp.job '{"checkpoint": "CKPT", ...}'

Each rank loads the model (transformers' FSDP path, or `load_for_fsdp`; the `trainer` loader then trains with TRL's
SFTTrainer, see `prequant.fsdp.job_sft`), checks that every packed weight's
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

import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import torch

from ..checkpoint.hf_files import CONFIG
from ..errors import PrequantError, UsageError

LOADERS = ("transformers", "prequant", "trainer")
DEFAULT_LOADERS = ("transformers", "prequant")  # trainer needs the `train` extra (trl, datasets)
BUFFER_DTYPES = ("bfloat16", "float32", "keep")
PACKED_STORAGES = ("uint8", "checkpoint")
GIB = 2**30
# The `trainer` loader's loss is TRL's SFTTrainer's: per-token log-probabilities from its own chunked kernel, summed
# over the token count, where the other loaders take the model's cross-entropy. The same number up to float32
# rounding (a unit or two in the last place on the tests' batches), so it is compared within this relative
# tolerance (about ten units in the last place). A real difference in what is computed moves it further: RoPE tables
# in bf16 instead of fp32 change the first loss of the tests' tiny Llama by 5.7e-6 relative.
SFT_LOSS_RTOL = 1e-6


# ----------------------------------------------------------------------------------------- launcher side


@dataclass
class CheckReport:
    """The reports of one check-fsdp run, one per loader, and how they compare."""

    checkpoint: str
    nproc: int
    runs: dict[str, dict] = field(default_factory=dict)

    @property
    def comparison(self) -> dict:
        """The first-step losses of every loader that reported some (two or more): all equal to the bit, and agreeing:
        the model's own loss equal across its loaders, SFTTrainer's within `SFT_LOSS_RTOL` of it."""
        first = {k: r["summary"]["losses"][0] for k, r in self.runs.items() if r.get("summary", {}).get("losses")}
        if len(first) < 2:
            return {}
        values = list(first.values())
        own = {v for k, v in first.items() if k != "trainer"}
        sft = [first["trainer"]] if "trainer" in first else []
        agree = len(own) <= 1 and all(math.isclose(a, b, rel_tol=SFT_LOSS_RTOL, abs_tol=0) for a in sft for b in own)
        return {"first_loss": first, "first_loss_equal": len(set(values)) == 1, "first_loss_agree": agree,
                "first_loss_abs_diff": max(values) - min(values), "sft_loss_rtol": SFT_LOSS_RTOL}

    @property
    def ok(self) -> bool:
        runs_ok = bool(self.runs) and all(r.get("summary", {}).get("ok") for r in self.runs.values())
        return runs_ok and self.comparison.get("first_loss_agree", True)

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
                    f"forward {s['mismatched_in_forward']}"
                    + (f" ({s['experts_not_routed']} experts no token was routed to, checked at rest only)"
                       if s.get("experts_not_routed") else "")
                    + f"; GPU load limit {lim['gpu_load'] / GIB:.2f} GiB "
                    f"(checkpoint/N + largest layer {lim['largest_layer'] / GIB:.2f} GiB), RssAnon limit "
                    f"{lim['rss_anon'] / GIB:.0f} GiB" + (f"; problems: {'; '.join(s['problems'])}" if s["problems"] else "")
                )
        c = self.comparison
        if c:
            verdict = "equal" if c["first_loss_equal"] else "DIFFERENT"
            if c["first_loss_agree"] and not c["first_loss_equal"]:
                verdict = f"agree (trainer within {SFT_LOSS_RTOL:g} relative: TRL computes the loss its own way)"
            losses = ", ".join(f"{k} {v:.8f}" for k, v in c["first_loss"].items())
            lines.append(f"first-step loss: {verdict} ({losses})")
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
        if c and not c["first_loss_agree"]:
            problems.append(f"first-step losses differ by {c['first_loss_abs_diff']:.3g} between the loaders")
        super().__init__("check-fsdp failed: " + "; ".join(problems or ["no run completed"]))


@dataclass(frozen=True, kw_only=True)
class CheckOptions:
    """The options of `prequant check-fsdp`, by the CLI's names; `check()` says what is wrong with them."""

    nproc: int = 2
    loaders: tuple[str, ...] = DEFAULT_LOADERS
    steps: int = 10
    seed: int = 0
    batch_size: int = 2
    seq_len: int = 256
    lr: float = 1e-3
    lora_r: int = 16
    lora_alpha: int | None = None  # None: 2 * lora_r, as the CLI sets it
    buffer_dtype: str = "bfloat16"
    packed_storage: str = "uint8"
    timeout: float = 1800
    trust_remote_code: bool = False  # run the checkpoint's own model code (auto_map), in every loader

    def __post_init__(self) -> None:
        object.__setattr__(self, "loaders", tuple(self.loaders or DEFAULT_LOADERS))
        if self.lora_alpha is None:
            object.__setattr__(self, "lora_alpha", 2 * self.lora_r)

    def check(self) -> None:
        """Raise UsageError naming the first option that cannot work here."""
        if self.nproc < 1:
            raise UsageError(f"--nproc {self.nproc}: need at least 1 process")
        if torch.cuda.is_available() and self.nproc > torch.cuda.device_count():
            raise UsageError(f"--nproc {self.nproc}: only {torch.cuda.device_count()} GPUs here; use at most that many")
        for loader in self.loaders:
            if loader not in LOADERS:
                raise UsageError(f"--loader {loader!r}: use one of {', '.join(LOADERS)}")
        missing = [m for m in ("trl", "datasets") if "trainer" in self.loaders and importlib.util.find_spec(m) is None]
        if missing:
            raise UsageError(f"--loader trainer needs {' and '.join(missing)}: pip install 'prequant[train]'")
        if self.buffer_dtype not in BUFFER_DTYPES:
            raise UsageError(f"--buffer-dtype {self.buffer_dtype!r}: use one of {', '.join(BUFFER_DTYPES)}")
        if self.packed_storage not in PACKED_STORAGES:
            raise UsageError(f"--packed-storage {self.packed_storage!r}: use one of {', '.join(PACKED_STORAGES)}")
        if self.steps < 1:
            raise UsageError(f"--steps {self.steps}: need at least 1 step")

    @classmethod
    def pick(cls, values: Mapping[str, Any]) -> CheckOptions:
        """The options named in `values` (e.g. a CLI command's arguments), ignoring other names."""
        return cls(**{f.name: values[f.name] for f in fields(cls) if f.name in values})


@dataclass(frozen=True)
class JobRequest:
    """What one torchrun job (`prequant.fsdp.job`, on every rank) is asked: one loader, as one JSON argument."""

    checkpoint: str
    loader: str
    options: CheckOptions
    report: str | None = None  # where rank 0 writes its JSON report (None: stdout)

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "options": asdict(self.options)})

    @classmethod
    def from_json(cls, text: str) -> JobRequest:
        data = json.loads(text)
        return cls(**{**data, "options": CheckOptions(**data["options"])})


def check_fsdp(output_dir: str | Path, options: CheckOptions | None = None, **changes: Any) -> CheckReport:
    """Run the check-fsdp job under torchrun once per loader (in that order) and collect the reports.

    Options come as a `CheckOptions`, or as its fields by keyword, which override `options`. A run that fails or
    times out is recorded with its error; the others still run. The job's own output (progress, per-step losses)
    goes to stderr."""
    opts = replace(options or CheckOptions(), **changes)
    path = Path(output_dir)
    if not (path / CONFIG).is_file():
        raise UsageError(f"{path}: no config.json; pass a directory written by prequant convert")
    opts.check()
    _check_remote_code(path, opts.trust_remote_code)
    report = CheckReport(str(path), opts.nproc)
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(Path(__file__).resolve().parents[2]),
                                                     os.environ.get("PYTHONPATH", "")) if p)}
    for loader in opts.loaders:
        with tempfile.TemporaryDirectory(prefix="prequant-check-fsdp-") as tmp:
            out = Path(tmp) / "report.json"
            request = JobRequest(str(path), loader, opts, str(out))
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={opts.nproc}",
                   "-m", "prequant.fsdp.job", request.to_json()]
            print(f"check-fsdp: {loader}: {' '.join(cmd[2:])}", file=sys.stderr, flush=True)
            error = _run(cmd, env, opts.timeout)
            if out.is_file():
                report.runs[loader] = json.loads(out.read_text())
                if error:
                    report.runs[loader]["error"] = error
            else:
                report.runs[loader] = {"loader": loader, "error": error or "the job wrote no report"}
    return report


def _check_remote_code(path: Path, trusted: bool) -> None:
    """Refuse, before any rank starts, a checkpoint whose model is its own code (config.json's auto_map for a model
    type transformers does not know) unless --trust-remote-code: every rank would fail in from_pretrained/from_config
    with transformers' multi-line refusal."""
    config = json.loads((path / CONFIG).read_text())
    auto_map = config.get("auto_map") or {}
    if trusted or not any(k in auto_map for k in ("AutoConfig", "AutoModelForCausalLM")):
        return
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if config.get("model_type") not in CONFIG_MAPPING_NAMES:
        code = auto_map.get("AutoModelForCausalLM") or auto_map["AutoConfig"]
        raise UsageError(f"{path}: its model is the checkpoint's own code ({code}); pass --trust-remote-code to "
                         "run it")


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
