"""Benchmark FSDP+QLoRA from a 4-bit checkpoint on N ranks: transformers' path against prequant's `load_for_fsdp`,
memory per rank, packed bytes intact, losses.

    python scripts/bench/check_fsdp.py ./llama3-8b-nf4 --nproc 2
    python scripts/bench/check_fsdp.py ./llama3-8b-nf4 --nproc 2 --loader prequant --loader trainer --report r.json

Exit status: 0 when every check passes, 1 when one fails (the reasons on stderr, the report on stdout), 2 for usage
errors. The script runs itself under torchrun once per loader (`--rank-job LOADER`, every rank):

- `transformers`: the path the Hugging Face docs give for QLoRA with FSDP (peft's fsdp_config_qlora.yaml and the
  Trainer): `from_pretrained(dtype=bf16)` of the pre-quantized checkpoint with accelerate's FSDP environment
  (cpu-ram-efficient loading), peft LoRA on all linear layers, FSDP1 FULL_SHARD with peft's auto-wrap policy,
  use_orig_params=False, sync_module_states, BACKWARD_PRE, and mixed precision set to the quant-storage dtype for
  params, reductions and buffers (what `update_fsdp_plugin_peft` asks accelerate for). CPU offload, which the docs
  turn on for 24 GB GPUs, is left off: it would hide the GPU memory being measured.
- `prequant`: `load_for_fsdp`, trained by a plain loop.
- `trainer`: `load_for_fsdp` trained by TRL's SFTTrainer with `prequant.fsdp.trainer_args`, as a user's script would.

Each rank loads the model, checks that every packed weight's bytes survived sharding (the shards at rest, gathered;
and the unsharded weight bitsandbytes is handed in forward), then trains a few steps on a fixed random batch (the
same batch on every rank, so each step's loss is the unsharded model's loss). Peak RssAnon/RssFile (sampled from
/proc) and peak GPU memory are measured separately for the load and the training phase. The first-step losses of
the loaders are compared: the model's own loss equal to the bit, SFTTrainer's within `SFT_LOSS_RTOL`.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # this checkout's prequant

from prequant.fsdp import (  # noqa: E402
    Checkpoint,
    default_device,
    ensure_process_group,
    init_distributed,
    init_lora_weights,
    load_for_fsdp,
    local_rows,
    lora_config,
    packed_layers,
    shard_rows,
    trainer_args,
)

LOADERS = ("transformers", "prequant", "trainer")
DEFAULT_LOADERS = ("transformers", "prequant")  # trainer needs the `train` extra (trl, datasets)
BUFFER_DTYPES = ("bfloat16", "float32", "keep")
PACKED_STORAGES = ("uint8", "checkpoint")
GIB = 2**30
RSS_ANON_LIMIT = 2 * GIB  # per rank, with load_for_fsdp
# The `trainer` loader's loss is TRL's SFTTrainer's: per-token log-probabilities from its own chunked kernel, summed
# over the token count, where the other loaders take the model's cross-entropy. The same number up to float32
# rounding (a unit or two in the last place on the tests' batches), so it is compared within this relative
# tolerance (about ten units in the last place). A real difference in what is computed moves it further: RoPE tables
# in bf16 instead of fp32 change the first loss of the tests' tiny Llama by 5.7e-6 relative.
SFT_LOSS_RTOL = 1e-6
# A routed expert's layer, by its name (Grok-1's moe.3.linear, Mixtral's block_sparse_moe.experts.3.w1, experts.3.*):
# a forward over a short batch runs only the experts its tokens were routed to, so the others are checked at rest only.
_EXPERT = re.compile(r"\.(?:experts?|moe)\.\d+\.")


class Usage(Exception):
    """A usage error: printed as one line, exit status 2."""


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", help="a directory written by prequant convert")
    ap.add_argument("--nproc", type=int, default=2, help="ranks (one GPU each; gloo on the CPU without CUDA)")
    ap.add_argument("--loader", action="append", dest="loaders", metavar="NAME",
                    help=f"{', '.join(LOADERS)}; repeatable (default: {' and '.join(DEFAULT_LOADERS)})")
    ap.add_argument("--steps", type=int, default=10, help="training steps on the fixed batch")
    ap.add_argument("--seed", type=int, default=0, help="seed of the batch and of the LoRA init")
    ap.add_argument("--batch-size", type=int, default=2, help="sequences in the batch")
    ap.add_argument("--seq-len", type=int, default=256, help="tokens per sequence")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--lora-r", type=int, default=16, help="LoRA rank (alpha: twice it)")
    ap.add_argument("--buffer-dtype", default="bfloat16", help="floating buffers (RoPE) in bfloat16 as HF's Trainer "
                    "casts them, float32, or keep")
    ap.add_argument("--packed-storage", default="uint8", help="prequant loader: uint8 (safe) or checkpoint (bf16 as "
                    "stored; bitsandbytes #1945)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds allowed per loader run")
    ap.add_argument("--trust-remote-code", action="store_true", help="run the checkpoint's own model code")
    ap.add_argument("--report", metavar="FILE", help="also write the JSON report here")
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    ap.add_argument("--rank-job", metavar="LOADER", help=argparse.SUPPRESS)  # one rank of one loader's run
    return ap


def check_options(o: argparse.Namespace) -> None:
    """Raise Usage naming the first option that cannot work here."""
    path = Path(o.checkpoint)
    if not (path / "config.json").is_file():
        raise Usage(f"{path}: no config.json; pass a directory written by prequant convert")
    if o.nproc < 1:
        raise Usage(f"--nproc {o.nproc}: need at least 1 process")
    if torch.cuda.is_available() and o.nproc > torch.cuda.device_count():
        raise Usage(f"--nproc {o.nproc}: only {torch.cuda.device_count()} GPUs here; use at most that many")
    for loader in o.loaders:
        if loader not in LOADERS:
            raise Usage(f"--loader {loader!r}: use one of {', '.join(LOADERS)}")
    missing = [m for m in ("trl", "datasets") if "trainer" in o.loaders and importlib.util.find_spec(m) is None]
    if missing:
        raise Usage(f"--loader trainer needs {' and '.join(missing)}: pip install -e '.[train]'")
    if o.buffer_dtype not in BUFFER_DTYPES:
        raise Usage(f"--buffer-dtype {o.buffer_dtype!r}: use one of {', '.join(BUFFER_DTYPES)}")
    if o.packed_storage not in PACKED_STORAGES:
        raise Usage(f"--packed-storage {o.packed_storage!r}: use one of {', '.join(PACKED_STORAGES)}")
    if o.steps < 1:
        raise Usage(f"--steps {o.steps}: need at least 1 step")
    check_remote_code(path, o.trust_remote_code)


# -------------------------------------------------------------------------------- launcher side


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


def failures(report: CheckReport) -> str:
    """What failed, in one line: each loader's problems, and the comparison's."""
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
    return "check-fsdp failed: " + "; ".join(problems or ["no run completed"])


def check_remote_code(path: Path, trusted: bool) -> None:
    """Refuse, before any rank starts, a checkpoint whose model is its own code (config.json's auto_map for a model
    type transformers does not know) unless --trust-remote-code: every rank would fail in from_pretrained/from_config
    with transformers' multi-line refusal."""
    config = json.loads((path / "config.json").read_text())
    auto_map = config.get("auto_map") or {}
    if trusted or not any(k in auto_map for k in ("AutoConfig", "AutoModelForCausalLM")):
        return
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if config.get("model_type") not in CONFIG_MAPPING_NAMES:
        code = auto_map.get("AutoModelForCausalLM") or auto_map["AutoConfig"]
        raise Usage(f"{path}: its model is the checkpoint's own code ({code}); pass --trust-remote-code to run it")


def run_loaders(o: argparse.Namespace) -> CheckReport:
    """Run every loader's job under torchrun, in order, and collect the reports. A run that fails or times out is
    recorded with its error; the others still run. The jobs' own output (progress, per-step losses) goes to stderr."""
    report = CheckReport(str(o.checkpoint), o.nproc)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    shared = [str(o.checkpoint), "--steps", str(o.steps), "--seed", str(o.seed), "--batch-size", str(o.batch_size),
              "--seq-len", str(o.seq_len), "--lr", str(o.lr), "--lora-r", str(o.lora_r), "--buffer-dtype",
              o.buffer_dtype, "--packed-storage", o.packed_storage, *(["--trust-remote-code"] * o.trust_remote_code)]
    for loader in o.loaders:
        with tempfile.TemporaryDirectory(prefix="check-fsdp-") as tmp:
            out = Path(tmp) / "report.json"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={o.nproc}",
                   __file__, *shared, "--rank-job", loader, "--report", str(out)]
            print(f"check-fsdp: {loader}: {' '.join(cmd[2:])}", file=sys.stderr, flush=True)
            error = run_torchrun(cmd, env, o.timeout)
            if out.is_file():
                report.runs[loader] = json.loads(out.read_text())
                if error:
                    report.runs[loader]["error"] = error
            else:
                report.runs[loader] = {"loader": loader, "error": error or "the job wrote no report"}
    return report


def run_torchrun(cmd: list[str], env: dict[str, str], timeout: float) -> str | None:
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


# -------------------------------------------------------------------------------- each rank


def autocast(device: torch.device) -> torch.autocast:
    """bf16 autocast around forward, as accelerate applies it for the Trainer's `bf16=True` (the HF FSDP-QLoRA
    recipe). transformers' path needs it: peft casts LoRA inputs to the fp32 master weight's dtype, FSDP1 then
    hands the layer bf16 weights. Both loaders run under it, so their losses compare like for like."""
    return torch.autocast(device.type, dtype=torch.bfloat16)


def load_transformers(o: argparse.Namespace, device: torch.device) -> torch.nn.Module:
    """transformers' FSDP+QLoRA path, as accelerate + the Trainer set it up (see the module docstring)."""
    from peft import get_peft_model
    from peft.utils.other import fsdp_auto_wrap_policy
    from torch.distributed.fsdp import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from transformers import AutoModelForCausalLM

    # What `accelerate launch` with fsdp_config_qlora.yaml exports; transformers reads them in from_pretrained.
    os.environ.setdefault("ACCELERATE_USE_FSDP", "true")
    os.environ.setdefault("FSDP_CPU_RAM_EFFICIENT_LOADING", "true")
    # The recipe: dtype = bnb_4bit_quant_storage, and the Trainer's FSDP mixed precision uses it for all three.
    storage = getattr(torch, str(_quantization_config(o.checkpoint).get("bnb_4bit_quant_storage", "bfloat16")))
    storage = storage if storage.is_floating_point else torch.bfloat16  # uint8 storage cannot shard under FSDP1
    model = AutoModelForCausalLM.from_pretrained(o.checkpoint, dtype=storage, trust_remote_code=o.trust_remote_code)
    model.config.use_cache = False
    model = get_peft_model(model, lora_config(o.lora_r, 2 * o.lora_r, 0.0, "all-linear"))
    init_lora_weights(model, o.seed)
    model.train()  # the Trainer trains in train mode (bitsandbytes' CPU path also repacks weights in eval mode)
    mp = MixedPrecision(param_dtype=storage, reduce_dtype=storage, buffer_dtype=_buffer_dtype(o))
    return FSDP(model, sharding_strategy=ShardingStrategy.FULL_SHARD, auto_wrap_policy=fsdp_auto_wrap_policy(model),
                mixed_precision=mp, cpu_offload=CPUOffload(offload_params=False),
                backward_prefetch=BackwardPrefetch.BACKWARD_PRE, forward_prefetch=False, limit_all_gathers=True,
                use_orig_params=False, sync_module_states=device.type == "cuda",  # FSDP1 broadcasts on GPUs only
                device_id=device)


def load_prequant(o: argparse.Namespace, device: torch.device) -> torch.nn.Module:
    """`load_for_fsdp` with the request's LoRA settings (also the `trainer` loader's model)."""
    return load_for_fsdp(o.checkpoint, lora_r=o.lora_r, lora_alpha=2 * o.lora_r, seed=o.seed, device=device,
                         buffer_dtype=_buffer_dtype(o), packed_storage=o.packed_storage,
                         trust_remote_code=o.trust_remote_code)


def _quantization_config(checkpoint: str) -> dict:
    return json.loads((Path(checkpoint) / "config.json").read_text()).get("quantization_config") or {}


def _buffer_dtype(options: Any) -> torch.dtype | None:
    return None if options.buffer_dtype == "keep" else getattr(torch, options.buffer_dtype)


class PackedBytes:
    """Compares packed weights with the checkpoint's bytes: the shards at rest (gathered) and the unsharded
    weight each Linear4bit receives in forward (where FSDP2's bf16 NaN canonicalization would show)."""

    def __init__(self, checkpoint: str, device: torch.device) -> None:
        self.ckpt = Checkpoint(checkpoint)
        self.device = device
        self.result = {"tensors": 0, "bytes": 0, "nan_patterns": 0, "mismatched_at_rest": 0,
                       "mismatched_in_forward": 0, "nan_canonicalized": 0, "checked_in_forward": 0,
                       "not_in_forward": [], "first_bad": []}

    def expected(self, prefix: str) -> torch.Tensor:
        return self.ckpt.view(prefix + ".weight").reshape(-1).view(torch.uint8).to(self.device)

    def _compare(self, prefix: str, got: torch.Tensor, where: str) -> None:
        want = self.expected(prefix)
        if where == "at_rest":  # once per tensor: its size, and how many bf16 words are NaN bit patterns
            self.result["tensors"] += 1
            self.result["bytes"] += want.numel()
            if want.numel() % 2 == 0:  # exponent all ones, mantissa nonzero
                w = want.view(torch.int16)
                self.result["nan_patterns"] += int((((w & 0x7F80) == 0x7F80) & ((w & 0x7F) != 0)).sum())
        got = got.detach().reshape(-1).view(torch.uint8)
        bad = int((got != want).sum()) if got.numel() == want.numel() else max(got.numel(), want.numel())
        self.result[f"mismatched_{where}"] += bad
        if bad and got.numel() == want.numel() and want.numel() % 2 == 0:
            g16, w16 = got.view(torch.int16), want.view(torch.int16)
            canon = (g16 != w16) & ((g16 == 0x7FFF) | (g16 == 0x7FC0) | (g16 == -1) | (g16 == -64))
            self.result["nan_canonicalized"] += int(canon.sum())
        if bad and len(self.result["first_bad"]) < 5:
            self.result["first_bad"].append(f"{prefix} ({where}: {bad} bytes)")

    def at_rest(self, model: torch.nn.Module, loader: str) -> None:
        if loader == "transformers":
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

            with FSDP.summon_full_params(model, writeback=False):
                for prefix, module in packed_layers(model):
                    self._compare(prefix, module.weight, "at_rest")
            return
        for prefix, module in packed_layers(model):
            self._compare(prefix, _gather_bytes(module.weight), "at_rest")

    def in_forward(self, model: torch.nn.Module, batch: torch.Tensor) -> None:
        """Compare the weight each packed layer receives in one forward pass; `checked_in_forward` counts the layers
        that ran, `not_in_forward` names those that did not (in an MoE model, the experts no token was routed to)."""
        handles, ran, layers = [], set(), [prefix for prefix, _ in packed_layers(model)]
        for prefix, module in packed_layers(model):
            def hook(mod: torch.nn.Module, args: Any, prefix: str = prefix) -> None:
                if prefix not in ran:  # an expert may run more than once in a forward; its bytes are the same
                    ran.add(prefix)
                    self._compare(prefix, mod.weight, "in_forward")

            handles.append(module.register_forward_pre_hook(hook))
        try:
            with torch.no_grad(), autocast(batch.device):
                model(input_ids=batch, labels=batch)
        finally:
            for h in handles:
                h.remove()
        self.result["checked_in_forward"] = len(ran)
        self.result["not_in_forward"] = [prefix for prefix in layers if prefix not in ran]

    def close(self) -> None:
        self.ckpt.close()


def _gather_bytes(param: torch.Tensor) -> torch.Tensor:
    """All the bytes of an FSDP2 dim-0 sharded parameter, gathered as uint8 (never through a float op, and not
    with DTensor.full_tensor(), which crashes on bf16-packed Params4bit: bitsandbytes issue #1945)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor):
        return param.detach().reshape(-1).view(torch.uint8)

    local = param.to_local().detach().reshape(-1).view(torch.uint8)
    mesh = param.device_mesh
    rows, size = param.shape[0], mesh.size()
    row_bytes = param.element_size() * math.prod(param.shape[1:])
    chunk = shard_rows(rows, 0, size)[1] * row_bytes
    padded = torch.zeros(chunk, dtype=torch.uint8, device=local.device)
    padded[: local.numel()] = local
    parts = [torch.empty_like(padded) for _ in range(size)]
    dist.all_gather(parts, padded, group=mesh.get_group())
    assert local_rows(param)[0] * row_bytes == mesh.get_local_rank() * chunk
    return torch.cat(parts)[: rows * row_bytes]


def _checkpoint_bytes_held(model: torch.nn.Module, loader: str) -> int | None:
    """Bytes of this rank's shards of the checkpoint's parameters (LoRA aside): what load_for_fsdp read for it.
    None for transformers' path (FSDP1 flattens the parameters)."""
    if loader == "transformers":
        return None
    from torch.distributed.tensor import DTensor

    return sum((p.to_local() if isinstance(p, DTensor) else p).nbytes for n, p in model.named_parameters()
               if ".lora_" not in n)


def _train(model: torch.nn.Module, batch: torch.Tensor, steps: int, lr: float) -> tuple[list[float], bool]:
    from torch.distributed.tensor import DTensor

    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    losses, grads_finite = [], True
    for step in range(steps):
        with autocast(batch.device):
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        if step == 0:
            grads = [(p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad) for p in params if p.grad is not None]
            grads_finite = bool(grads) and all(bool(torch.isfinite(g).all()) for g in grads)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if torch.distributed.get_rank() == 0:
            print(f"check-fsdp: step {step + 1}/{steps} loss {losses[-1]:.6f}", file=sys.stderr, flush=True)
    return losses, grads_finite


def rank_job(o: argparse.Namespace) -> None:
    """One loader's run, on every rank (under torchrun): load, check bytes, train, report (rank 0 writes the JSON
    to --report)."""
    import torch.distributed as dist

    loader = o.rank_job
    sampler = MemorySampler()
    if loader == "trainer":  # as a user's script: the process group comes the way Trainer sets it up
        device = default_device()
        ensure_process_group(device)
    else:
        device = init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    ckpt = Checkpoint(o.checkpoint)
    vocab = int(ckpt.config.get("vocab_size") or ckpt.config.get("text_config", {}).get("vocab_size"))
    limits = {"checkpoint": ckpt.nbytes, "largest_layer": largest_layer_bytes(ckpt), "rss_anon": RSS_ANON_LIMIT}
    limits["gpu_load"] = limits["checkpoint"] // world + limits["largest_layer"]
    ckpt.close()
    import bitsandbytes  # noqa: F401  (imported before the clock starts: the load phase measures loading)
    import peft  # noqa: F401
    import transformers  # noqa: F401

    sampler.reset()
    gpu_peaks(device)
    before = MemorySampler.read()  # libraries are mapped already: what RssFile adds from here is the checkpoint
    t0 = time.monotonic()
    model = (load_transformers if loader == "transformers" else load_prequant)(o, device)
    dist.barrier()
    load = {"seconds": time.monotonic() - t0, **gpu_peaks(device), **prefixed(sampler.reset(), "peak_"),
            **prefixed(before, "at_start_"), "checkpoint_bytes_held": _checkpoint_bytes_held(model, loader)}

    batch = torch.randint(0, vocab, (o.batch_size, o.seq_len), generator=torch.Generator().manual_seed(o.seed))
    batch = batch.to(device)
    check = PackedBytes(o.checkpoint, device)
    check.at_rest(model, loader)
    check.in_forward(model, batch)
    check.close()
    dist.barrier()
    sampler.reset()
    gpu_peaks(device)

    t0 = time.monotonic()
    if loader == "trainer":
        losses, grads_finite = train_sft(model, batch, o)
    else:
        losses, grads_finite = _train(model, batch, o.steps, o.lr)
    dist.barrier()
    train = {"seconds": time.monotonic() - t0, **gpu_peaks(device), **prefixed(sampler.reset(), "peak_")}
    sampler.stop()

    mine = {"rank": rank, "load": load, "train": train, "losses": losses, "grads_finite": grads_finite,
            "packed": check.result}
    ranks = [None] * world
    dist.all_gather_object(ranks, mine)
    if rank == 0:
        report = {"loader": loader, "world_size": world, "device": str(device),
                  "options": vars(o), "limits": limits, "ranks": ranks,
                  "summary": summarize(loader, ranks, limits, device)}
        text = json.dumps(report, indent=2, default=str)
        Path(o.report).write_text(text)
    dist.barrier()
    dist.destroy_process_group()


def train_sft(model: torch.nn.Module, batch: torch.Tensor, options: Any) -> tuple[list[float], bool]:
    """Train `options.steps` steps of `batch` with SFTTrainer; returns (per-step losses, first-step LoRA gradients
    all finite). The losses are Trainer's logged ones (`logging_steps=1`): each the mean over all ranks.

    The run sees exactly the batch the other loaders see: a pre-tokenized dataset of the batch's rows repeated,
    sampled in order, `per_device_train_batch_size` = the batch, so every rank's every step is the batch. The
    optimizer is the plain loop's (AdamW, constant learning rate, no weight decay, no gradient clipping) and gradient
    checkpointing is off, as there. SFTTrainer still wants a tokenizer (for its pad token): it gets a two-token one,
    since a benchmark's random checkpoint has none."""
    import torch.distributed as dist
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import SFTConfig, SFTTrainer

    world = dist.get_world_size()
    rows = [row.tolist() for row in batch.cpu()] * (world * options.steps)
    grads = {"finite": False, "seen": False}

    class Probe(TrainerCallback):
        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
            if not grads["seen"]:  # the first step's gradients, before the optimizer uses them
                grads["seen"] = True
                local = [_local(p.grad) for p in model.parameters() if p.requires_grad and p.grad is not None]
                grads["finite"] = bool(local) and all(bool(torch.isfinite(g).all()) for g in local)

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
            if state.is_world_process_zero and logs and "loss" in logs:
                print(f"check-fsdp: step {state.global_step}/{options.steps} loss {logs['loss']:.6f}",
                      file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory(prefix="check-fsdp-sft-") as out:
        config = SFTConfig(
            output_dir=out, max_steps=options.steps, per_device_train_batch_size=batch.shape[0],
            gradient_accumulation_steps=1, learning_rate=options.lr, lr_scheduler_type="constant", weight_decay=0.0,
            max_grad_norm=0.0, optim="adamw_torch", logging_steps=1, save_strategy="no", report_to="none",
            bf16=True, use_cpu=batch.device.type == "cpu", gradient_checkpointing=False,
            train_sampling_strategy="sequential", max_length=batch.shape[1], seed=options.seed, disable_tqdm=True)
        dataset = Dataset.from_dict({"input_ids": rows})
        trainer = SFTTrainer(model=model, args=trainer_args(config), train_dataset=dataset,
                             processing_class=_pad_tokenizer(), callbacks=[Probe()])
        trainer.train()
    losses = [float(h["loss"]) for h in trainer.state.log_history if "loss" in h]
    return losses, grads["finite"] and all(math.isfinite(x) for x in losses)


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _pad_tokenizer() -> Any:
    """A tokenizer that only knows a pad token (id 0) and an unknown token: all SFTTrainer needs for token ids."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    tok = Tokenizer(models.WordLevel({"<pad>": 0, "<unk>": 1}, unk_token="<unk>"))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>")


# -------------------------------------------------------------------------------- measures and verdict


class MemorySampler:
    """Samples this process' RssAnon and RssFile from /proc/self/status in a thread; keeps phase peaks."""

    def __init__(self, interval: float = 0.005) -> None:
        self.interval = interval
        self.peak = {"RssAnon": 0, "RssFile": 0}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    @staticmethod
    def read() -> dict[str, int]:
        values = {}
        for line in Path("/proc/self/status").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ("RssAnon", "RssFile"):
                values[key] = int(rest.split()[0]) * 1024
        return values

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.sample()
            time.sleep(self.interval)

    def sample(self) -> None:
        now = self.read()
        with self._lock:
            for k, v in now.items():
                self.peak[k] = max(self.peak[k], v)

    def reset(self) -> dict[str, int]:
        """The peaks since the last reset (sampled once more now), then start over from the current values."""
        self.sample()
        with self._lock:
            peaks, self.peak = dict(self.peak), self.read()
        return peaks

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1)


def gpu_peaks(device: torch.device) -> dict[str, int]:
    """GPU memory peaks since the last call (then reset); zeros off CUDA."""
    if device.type != "cuda":
        return {"peak_gpu_allocated": 0, "peak_gpu_reserved": 0, "gpu_allocated": 0}
    torch.cuda.synchronize(device)
    peaks = {"peak_gpu_allocated": torch.cuda.max_memory_allocated(device),
             "peak_gpu_reserved": torch.cuda.max_memory_reserved(device),
             "gpu_allocated": torch.cuda.memory_allocated(device)}
    torch.cuda.reset_peak_memory_stats(device)
    return peaks


def largest_layer_bytes(ckpt: Any) -> int:
    """Bytes of the largest layer in the checkpoint: a decoder block (`...layers.N.`) or a top-level module."""
    sizes: dict[str, int] = {}
    for name, ref in ckpt.tensors.items():
        m = re.match(r"^(.*?\.\d+)\.", name)  # model.layers.7.… -> model.layers.7
        key = m.group(1) if m else re.sub(r"\.(weight|bias)(\..*)?$", "", name)  # lm_head.weight -> lm_head
        sizes[key] = sizes.get(key, 0) + ref.nbytes
    return max(sizes.values(), default=0)


def prefixed(d: dict[str, int], prefix: str) -> dict[str, int]:
    """MemorySampler's keys as the report spells them: RssAnon -> peak_rss_anon."""
    return {prefix + k.lower().replace("rss", "rss_"): v for k, v in d.items()}


def summarize(loader: str, ranks: list[dict], limits: dict, device: torch.device) -> dict:
    """The verdict of one run over all ranks: losses finite and decreasing, bytes intact, (prequant) limits."""
    losses = ranks[0]["losses"]
    finite = bool(losses) and all(math.isfinite(x) for r in ranks for x in r["losses"])
    decreasing = finite and len(losses) > 1 and losses[-1] < losses[0]
    monotonic = decreasing and all(b < a for a, b in itertools.pairwise(losses))
    agree = all(r["losses"] == losses for r in ranks)
    intact = all(r["packed"]["mismatched_at_rest"] == 0 and r["packed"]["mismatched_in_forward"] == 0 for r in ranks)
    unrun = sorted({p for r in ranks for p in r["packed"].get("not_in_forward", [])})
    unrouted = [p for p in unrun if _EXPERT.search(p)]  # the experts no token of the batch went to
    missed = [p for p in unrun if not _EXPERT.search(p)]  # a layer that should have run and did not
    s = {
        "losses": losses, "finite": finite, "decreasing": decreasing, "monotonic": monotonic, "ranks_agree": agree,
        "grads_finite": all(r["grads_finite"] for r in ranks), "packed_intact": intact,
        "packed_tensors": ranks[0]["packed"]["tensors"], "nan_patterns": ranks[0]["packed"]["nan_patterns"],
        "mismatched_at_rest": max(r["packed"]["mismatched_at_rest"] for r in ranks),
        "mismatched_in_forward": max(r["packed"]["mismatched_in_forward"] for r in ranks),
        "nan_canonicalized": max(r["packed"]["nan_canonicalized"] for r in ranks),
        "checked_in_forward": min(r["packed"]["checked_in_forward"] for r in ranks),
        "experts_not_routed": len(unrouted),
        "load_seconds": max(r["load"]["seconds"] for r in ranks),
        "peak_gpu_load": max(r["load"]["peak_gpu_allocated"] for r in ranks),
        "peak_gpu_train": max(r["train"]["peak_gpu_allocated"] for r in ranks),
        "peak_rss_anon": max(max(r["load"]["peak_rss_anon"], r["train"]["peak_rss_anon"]) for r in ranks),
        "peak_rss_anon_load": max(r["load"]["peak_rss_anon"] for r in ranks),
        "peak_rss_file": max(max(r["load"]["peak_rss_file"], r["train"]["peak_rss_file"]) for r in ranks),
        "limits": limits,
    }
    problems = []
    if not finite:
        problems.append("a loss is not finite")
    elif len(losses) == 1:
        problems.append("one step only: a loss cannot be seen to decrease (run --steps 2 or more)")
    elif not decreasing:
        problems.append("the loss did not decrease")
    if not agree:
        problems.append("ranks disagree on the loss of the same batch")
    if not s["grads_finite"]:
        problems.append("LoRA gradients missing or not finite")
    if not intact:
        problems.append(f"packed bytes changed ({s['mismatched_at_rest']} at rest, {s['mismatched_in_forward']} in "
                        f"forward, {s['nan_canonicalized']} bf16 words turned into a canonical NaN)")
    if missed:
        problems.append(f"{len(missed)} packed layers never ran in the forward pass that checks their bytes "
                        f"(e.g. {missed[0]}): checked at rest only")
    if loader in ("prequant", "trainer") and device.type == "cuda":  # both load with load_for_fsdp
        if s["peak_gpu_load"] > limits["gpu_load"]:
            problems.append(f"peak GPU memory during load {s['peak_gpu_load'] / GIB:.2f} GiB is over the limit "
                            f"{limits['gpu_load'] / GIB:.2f} GiB")
        # The limit is on what loading costs; the trainer loader's training phase also holds TRL, datasets and Arrow.
        anon, phase = (s["peak_rss_anon_load"], " during load") if loader == "trainer" else (s["peak_rss_anon"], "")
        if anon > limits["rss_anon"]:
            problems.append(f"peak RssAnon{phase} {anon / GIB:.2f} GiB is over {limits['rss_anon'] / GIB:.0f} GiB")
    s["problems"] = problems
    s["ok"] = not problems
    return s


def options(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line's options, defaults filled in."""
    o = parser().parse_args(argv)
    o.loaders = tuple(o.loaders or DEFAULT_LOADERS)
    return o


def main() -> None:
    o = options()
    if o.rank_job:
        rank_job(o)
        return
    try:
        check_options(o)
    except Usage as e:
        print(f"Error: {e}", file=sys.stderr)
        sys.exit(2)
    report = run_loaders(o)
    text = json.dumps(report.to_dict(), indent=2)
    if o.report:
        Path(o.report).write_text(text)
    print(text if o.json else report.to_text())
    if not report.ok:
        print(f"Error: {failures(report)}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
