"""check-fsdp's job on one torchrun rank: load, check the packed bytes, train, report (see `prequant.fsdp.check`).
The `trainer` loader trains with TRL's SFTTrainer (`prequant.fsdp.job_sft`), the others with a plain loop.

`prequant check-fsdp` (`prequant.fsdp.check.check_fsdp`) launches it once per loader, with one JSON request
(`check.JobRequest`):

    python -m torch.distributed.run --standalone --nproc_per_node 2 -m prequant.fsdp.job '{"checkpoint": ...}'
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from ..errors import PrequantError
from .check import JobRequest
from .checkpoint import Checkpoint
from .distributed import default_device, ensure_process_group, init_distributed
from .loader import load_for_fsdp
from .lora import init_lora_weights, lora_config
from .report import RSS_ANON_LIMIT, MemorySampler, gpu_peaks, largest_layer_bytes, prefixed, summarize
from .sharding import local_rows, packed_layers, shard_rows


def autocast(device: torch.device) -> torch.autocast:
    """bf16 autocast around forward, as accelerate applies it for the Trainer's `bf16=True` (the HF FSDP-QLoRA
    recipe). transformers' path needs it: peft casts LoRA inputs to the fp32 master weight's dtype, FSDP1 then
    hands the layer bf16 weights. Both loaders run under it, so their losses compare like for like."""
    return torch.autocast(device.type, dtype=torch.bfloat16)


def load_transformers(req: JobRequest, device: torch.device) -> torch.nn.Module:
    """transformers' FSDP+QLoRA path, as accelerate + the Trainer set it up (see `prequant.fsdp.check`'s docstring)."""
    from peft import get_peft_model
    from peft.utils.other import fsdp_auto_wrap_policy
    from torch.distributed.fsdp import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from transformers import AutoModelForCausalLM

    # What `accelerate launch` with fsdp_config_qlora.yaml exports; transformers reads them in from_pretrained.
    os.environ.setdefault("ACCELERATE_USE_FSDP", "true")
    os.environ.setdefault("FSDP_CPU_RAM_EFFICIENT_LOADING", "true")
    # The recipe: dtype = bnb_4bit_quant_storage, and the Trainer's FSDP mixed precision uses it for all three.
    storage = getattr(torch, str(_quantization_config(req.checkpoint).get("bnb_4bit_quant_storage", "bfloat16")))
    storage = storage if storage.is_floating_point else torch.bfloat16  # uint8 storage cannot shard under FSDP1
    model = AutoModelForCausalLM.from_pretrained(req.checkpoint, dtype=storage,
                                                 trust_remote_code=req.options.trust_remote_code)
    model.config.use_cache = False
    o = req.options
    model = get_peft_model(model, lora_config(o.lora_r, o.lora_alpha, 0.0, "all-linear"))
    init_lora_weights(model, o.seed)
    model.train()  # the Trainer trains in train mode (bitsandbytes' CPU path also repacks weights in eval mode)
    mp = MixedPrecision(param_dtype=storage, reduce_dtype=storage, buffer_dtype=_buffer_dtype(o))
    return FSDP(model, sharding_strategy=ShardingStrategy.FULL_SHARD, auto_wrap_policy=fsdp_auto_wrap_policy(model),
                mixed_precision=mp, cpu_offload=CPUOffload(offload_params=False),
                backward_prefetch=BackwardPrefetch.BACKWARD_PRE, forward_prefetch=False, limit_all_gathers=True,
                use_orig_params=False, sync_module_states=device.type == "cuda",  # FSDP1 broadcasts on GPUs only
                device_id=device)


def load_prequant(req: JobRequest, device: torch.device) -> torch.nn.Module:
    """`load_for_fsdp` with the request's LoRA settings (also the `trainer` loader's model)."""
    o = req.options
    return load_for_fsdp(req.checkpoint, lora_r=o.lora_r, lora_alpha=o.lora_alpha, seed=o.seed, device=device,
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
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"check-fsdp: step {step + 1}/{steps} loss {losses[-1]:.6f}", file=sys.stderr, flush=True)
    return losses, grads_finite


def main(argv: list[str] | None = None) -> None:
    """The job, on every rank (under torchrun): load, check bytes, train, report (rank 0 writes the JSON).
    Its one argument is a `check.JobRequest` as JSON."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        raise PrequantError(f"usage: python -m prequant.fsdp.job REQUEST_JSON (one argument, got {len(argv)})")
    req = JobRequest.from_json(argv[0])
    opts = req.options

    import torch.distributed as dist

    sampler = MemorySampler()
    if req.loader == "trainer":  # as a user's script: the process group comes the way Trainer sets it up
        device = default_device()
        ensure_process_group(device)
    else:
        device = init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    ckpt = Checkpoint(req.checkpoint)
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
    model = (load_transformers if req.loader == "transformers" else load_prequant)(req, device)
    dist.barrier()
    load = {"seconds": time.monotonic() - t0, **gpu_peaks(device), **prefixed(sampler.reset(), "peak_"),
            **prefixed(before, "at_start_"), "checkpoint_bytes_held": _checkpoint_bytes_held(model, req.loader)}

    batch = torch.randint(0, vocab, (opts.batch_size, opts.seq_len), generator=torch.Generator().manual_seed(opts.seed))
    batch = batch.to(device)
    check = PackedBytes(req.checkpoint, device)
    check.at_rest(model, req.loader)
    check.in_forward(model, batch)
    check.close()
    dist.barrier()
    sampler.reset()
    gpu_peaks(device)

    t0 = time.monotonic()
    if req.loader == "trainer":
        from .job_sft import train_sft

        losses, grads_finite = train_sft(model, batch, opts)
    else:
        losses, grads_finite = _train(model, batch, opts.steps, opts.lr)
    dist.barrier()
    train = {"seconds": time.monotonic() - t0, **gpu_peaks(device), **prefixed(sampler.reset(), "peak_")}
    sampler.stop()

    mine = {"rank": rank, "load": load, "train": train, "losses": losses, "grads_finite": grads_finite,
            "packed": check.result}
    ranks = [None] * world
    dist.all_gather_object(ranks, mine)
    if rank == 0:
        report = {"loader": req.loader, "world_size": world, "device": str(device),
                  "options": {"checkpoint": req.checkpoint, **vars(opts)}, "limits": limits, "ranks": ranks,
                  "summary": summarize(req.loader, ranks, limits, device)}
        text = json.dumps(report, indent=2, default=str)
        if req.report:
            Path(req.report).write_text(text)
        else:
            print(text)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main()
    except PrequantError as e:
        print(f"Error: {e.message}", file=sys.stderr)
        sys.exit(e.exit_code)
