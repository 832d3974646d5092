"""What check-fsdp measures on each rank (memory peaks, the largest layer) and its verdict over all ranks.

The job (`prequant.fsdp.job`) samples and times each phase with these; `summarize` turns every rank's figures
into the report's summary: losses finite, decreasing and equal on all ranks, packed bytes intact, and for
`load_for_fsdp` on GPUs (loaders `prequant` and `trainer`) the memory limits.
"""

from __future__ import annotations

import itertools
import math
import re
import threading
import time
from pathlib import Path
from typing import Any

import torch

GIB = 2**30

RSS_ANON_LIMIT = 2 * 2**30  # per rank, with load_for_fsdp
# A routed expert's layer, by its name (Grok-1's moe.3.linear, Mixtral's block_sparse_moe.experts.3.w1, experts.3.*):
# a forward over a short batch runs only the experts its tokens were routed to, so the others are checked at rest only.
_EXPERT = re.compile(r"\.(?:experts?|moe)\.\d+\.")


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
