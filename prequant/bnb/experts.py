"""Native MoE experts in 4-bit (`--quantize-experts`): which tensors are per-expert weights, and how transformers 5
fuses them.

Checkpoints of transformers-native MoE models (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3, GLM-4-MoE, and
the others transformers 5 maps the same way) hold one 2-D weight per expert and projection,
`<block>.experts.<N>.<proj>.weight` (`gate_proj`/`up_proj`/`down_proj`, Mixtral's `w1`/`w3`/`w2`). transformers 5
fuses them on load into `<block>.experts.gate_up_proj [E, 2I, H]` (each expert's gate rows, then its up rows) and
`<block>.experts.down_proj [E, H, I]`, which bitsandbytes does not quantize; transformers 4.x built them as
`nn.Linear` layers, which it did. `quantize_experts` turns a layout's kept expert weights into quantized ones,
each quantized as a Linear weight under its own name (transformers 4.x + bitsandbytes' layout), and lists each MoE
block's router in `llm_int8_skip_modules` by its full name (transformers 4.x builds Mixtral's, Qwen's and OLMoE's
as `nn.Linear` and would quantize them otherwise; routers stay in their dtype everywhere else).

Any other expert layout (gpt-oss's biased experts, fused and interleaved on disk; Llama 4's fused and transposed
ones) is refused: those are not one Linear weight per expert.
"""

from __future__ import annotations

import re
from dataclasses import replace

from ..checkpoint.tensors import TensorRef
from ..errors import PrequantError, skipping
from .layout import Decision, Layout
from .loading import should_convert

# `<block>.experts.<N>.<proj>.weight`: one expert's projection.
EXPERT = re.compile(r"^(?P<block>.+)\.experts\.(?P<index>\d+)\.(?P<proj>[A-Za-z0-9_]+)\.weight$")
# On-disk projection name -> its part of transformers 5's fused parameters.
ROLES = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}
ROUTER = "gate"  # the router of each MoE block: `<block>.gate.weight`
FLAG = "--quantize-experts"


def expert_match(name: str) -> re.Match[str] | None:
    """The match of a per-expert projection weight of a handled layout (`block`, `index`, `proj`), else None."""
    m = EXPERT.match(name)
    return m if m is not None and m["proj"] in ROLES else None


def is_expert_tensor(name: str) -> bool:
    """Whether a tensor belongs to a MoE block's experts (`....experts....`; a shared expert is not one)."""
    return "experts" in name.split(".")[:-1]


def quantize_experts(layout: Layout, tensors: list[TensorRef]) -> Layout:
    """`layout` with every expert weight transformers 5 fuses quantized as a Linear weight, and each MoE block's
    router kept through `llm_int8_skip_modules`. A tensor of the experts that is not one 2-D weight per expert is
    refused (PrequantError naming it). Expert weights matched by the written skip list stay kept."""
    shapes = {t.name: tuple(t.shape) for t in tensors}
    written = list(layout.skip_modules or [])
    decisions = dict(layout.decisions)
    blocks: set[str] = set()
    for name, d in layout.decisions.items():
        if d.quantize or not is_expert_tensor(name):
            continue
        m = expert_match(name)
        if m is None or not d.fused or len(shapes[name]) != 2:
            shape = "x".join(map(str, shapes[name])) or "scalar"
            raise PrequantError(
                f"{FLAG}: tensor {name!r} ({shape}) is not one 2-D Linear weight per expert, the only MoE layout "
                "prequant quantizes; fused experts (gpt-oss's, biased and interleaved, MXFP4 on disk or not; Llama 4's, "
                f"transposed) are not supported in 4-bit: convert without {FLAG}, and they stay 16-bit as "
                "transformers holds them"
            )
        blocks.add(m["block"])
        module = name.removesuffix(".weight")
        if not should_convert(module, written):
            decisions[name] = replace(d, reason="MoE expert, skipped (llm_int8_skip_modules)")
        else:
            decisions[name] = Decision(True, f"MoE expert, as nn.Linear ({FLAG})", dtype=d.dtype, fused=True)
    if not blocks:
        return replace(layout, notes=[*layout.notes, f"{FLAG}: this checkpoint has no MoE expert weights to quantize"])
    routers = sorted(f"{b}.{ROUTER}" for b in blocks if f"{b}.{ROUTER}.weight" in decisions)
    for router in routers:
        if decisions[f"{router}.weight"].quantize:
            raise PrequantError(f"{FLAG}: the router {router} would be quantized, which no loader expects; "
                                f"pass {skipping(router)}")
    defaults = written if layout.skip_modules is not None else layout.default_skips
    return replace(layout, decisions=decisions, skip_modules=sorted({*defaults, *routers}))
