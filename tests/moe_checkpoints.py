"""Tiny checkpoints of transformers-native MoE architectures, built from transformers 5 configs and saved as the Hub
checkpoints are (transformers 5 un-fuses its experts on save: one 2-D weight per expert and projection)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

# Sizes that bitsandbytes' CPU kernels get wrong (in features not a multiple of 64, out features not of 32): expert
# down projections with 32 inputs, routers with 4 outputs, Qwen2-MoE's one-output shared-expert gate.
_BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=256)
HANDLED = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "glm4_moe"]
REFUSED = ["gpt_oss", "llama4"]


def moe_config(kind: str, layers: int = 2):
    """A tiny config of each MoE layout (four experts, two per token), and a dense Llama; `layers` decoder layers."""
    import transformers as tf

    base = {**_BASE, "num_hidden_layers": layers}
    experts = dict(num_experts_per_tok=2)
    if kind == "mixtral":
        return tf.MixtralConfig(**base, num_local_experts=4, **experts)
    if kind == "qwen2_moe":  # a shared expert and its one-output gate
        return tf.Qwen2MoeConfig(**base, num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=64,
                                 **experts)
    if kind == "qwen3_moe":
        return tf.Qwen3MoeConfig(**base, num_experts=4, moe_intermediate_size=32, head_dim=16, **experts)
    if kind == "olmoe":
        return tf.OlmoeConfig(**base, num_experts=4, pad_token_id=1, eos_token_id=0, bos_token_id=None, **experts)
    if kind == "deepseek_v3":  # layer 0 dense, shared experts, a router with a correction bias
        return tf.DeepseekV3Config(**{**base, "num_key_value_heads": 4}, n_routed_experts=4,
                                   moe_intermediate_size=32, first_k_dense_replace=1, n_group=1, topk_group=1,
                                   kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16,
                                   v_head_dim=16, **experts)
    if kind == "glm4_moe":
        return tf.Glm4MoeConfig(**base, n_routed_experts=4, moe_intermediate_size=32, first_k_dense_replace=1,
                                n_group=1, topk_group=1, head_dim=16, **experts)
    if kind == "gpt_oss":  # experts fused on disk, with biases
        return tf.GptOssConfig(**base, num_local_experts=4, head_dim=16, **experts)
    if kind == "llama":  # dense: no experts at all
        return tf.LlamaConfig(**base)
    if kind == "llama4":  # experts fused on disk, transposed
        return tf.Llama4TextConfig(**base, num_local_experts=4, num_experts_per_tok=1, intermediate_size_mlp=128,
                                   head_dim=16)
    raise ValueError(kind)


def build_moe(kind: str, path: Path, seed: int = 0, layers: int = 2) -> Path:
    """Save a randomly initialised tiny MoE model (bf16). Untrained routers send every token to the same experts;
    the routers get random weights so that tokens reach all of them."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(moe_config(kind, layers), dtype=torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("mlp.gate.weight", "router.weight")):
                p.normal_(0, 1)
    model.save_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    if config["model_type"] == "qwen3_moe":  # its Hub configs (and transformers 4.x) name the expert count so
        config["num_experts"] = config["num_local_experts"]
        (path / "config.json").write_text(json.dumps(config, indent=2))
    (path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 64}))
    return path


# Ways a MoE checkpoint's experts can disagree with its config.json, each of which transformers' from_pretrained
# refuses: `break_experts` makes them.
DEFECTS = ["transposed", "missing", "extra", "reshaped"]


def break_experts(folder: Path, defect: str) -> list[str]:
    """Edit a tiny MoE checkpoint's one safetensors file on disk so that its experts disagree with config.json, and
    return the tensors concerned (those a refusal may name): "transposed", the last MoE block's expert 2 up projection
    stored as its transpose (same element count); "missing", the last expert removed from every MoE block; "extra",
    an expert more than config.json's count in every block (a copy of expert 0); "reshaped", the last block's expert
    1 with half the intermediate size in all its projections."""
    from safetensors.torch import load_file, save_file

    from prequant.bnb.experts import ROLES, expert_match

    (file,) = folder.glob("*.safetensors")
    tensors = load_file(file)
    experts: dict[str, dict[int, dict[str, str]]] = {}  # block -> index -> role -> name
    for name in tensors:
        if (m := expert_match(name)) is not None:
            experts.setdefault(m["block"], {}).setdefault(int(m["index"]), {})[ROLES[m["proj"]]] = name
    last = experts[max(experts, key=lambda b: int(b.split(".")[2]))]
    concerned: list[str] = []
    if defect == "transposed":
        name = last[2]["up"]
        tensors[name] = tensors[name].t().contiguous()
        concerned.append(name)
    elif defect == "missing":
        for block in experts.values():
            for name in block[max(block)].values():
                del tensors[name]
                concerned.append(name)
    elif defect == "extra":
        for block in experts.values():
            count = max(block) + 1
            for name in block[0].values():
                added = name.replace(".experts.0.", f".experts.{count}.")
                tensors[added] = tensors[name].clone()
                concerned.append(added)
    elif defect == "reshaped":
        for role, name in last[1].items():
            t = tensors[name]
            tensors[name] = (t[:, : t.shape[1] // 2] if role == "down" else t[: t.shape[0] // 2]).contiguous()
            concerned.append(name)
    else:
        raise ValueError(defect)
    save_file(tensors, file, metadata={"format": "pt"})
    return concerned


def dequantized(entries: dict[str, torch.Tensor]) -> torch.Tensor:
    """A 4-bit weight from its checkpoint entries (short names: weight, absmax, quant_map, nested_*, quant_state.*),
    dequantized as bitsandbytes' CUDA kernel does: code times block scale in float32, rounded once to the weight's
    dtype. Written here from the format, apart from prequant's own dequantization."""
    state = json.loads(bytes(next(v for k, v in entries.items() if k.startswith("quant_state.")).tolist()))
    raw = entries["weight"].reshape(-1).view(torch.uint8).long()
    codes = torch.stack([raw >> 4, raw & 15], dim=1).reshape(-1)
    absmax = entries["absmax"]
    if "nested_absmax" in entries:
        scale = entries["nested_absmax"].float().repeat_interleave(256)[: absmax.numel()]
        absmax = entries["nested_quant_map"].float()[absmax.long()] * scale + state["nested_offset"]
    n = 1
    for d in state["shape"]:
        n *= d
    block = state["blocksize"]
    values = entries["quant_map"].float()[codes[:n]] * absmax.float().repeat_interleave(block)[:n]
    return values.to(getattr(torch, state["dtype"])).view(state["shape"])


def read_all(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint folder's safetensors files."""
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def entries_of(tensors: dict[str, torch.Tensor], weight: str) -> dict[str, torch.Tensor]:
    """A 4-bit weight's entries by short name."""
    return {k[len(weight) + 1:] if k != weight else "weight": v for k, v in tensors.items()
            if k == weight or k.startswith(weight + ".")}


# Token ids every load_model logits test feeds.
IDS = (torch.arange(0, 224, 7).view(2, -1) * 5) % 256


def dequantized_reference(src: Path, out: Path):
    """The source in transformers 5 with every weight that `out` holds in 4-bit replaced by its dequantized value
    (experts placed in transformers' fused parameters: gate rows, then up rows); kept weights keep the source's."""
    from transformers import AutoModelForCausalLM

    from prequant.bnb.experts import expert_match

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).eval()
    output = read_all(out)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for key in output:
            if not key.endswith(".weight") or f"{key}.absmax" not in output:
                continue
            w = dequantized(entries_of(output, key))
            m = expert_match(key)
            if m is None:
                params[key].copy_(w)
                continue
            block = m["block"].replace(".block_sparse_moe", ".mlp")
            e, proj = int(m["index"]), m["proj"]
            if proj in ("down_proj", "w2"):
                params[f"{block}.experts.down_proj"][e].copy_(w)
            else:
                rows = w.shape[0]
                part = slice(0, rows) if proj in ("gate_proj", "w1") else slice(rows, 2 * rows)
                params[f"{block}.experts.gate_up_proj"][e, part].copy_(w)
    return model


def logits_of(model, implementation: str | None = None) -> torch.Tensor:
    """`model`'s float32 CPU logits of `IDS` (its experts computed by `implementation`, when given)."""
    if implementation is not None:
        model.set_experts_implementation(implementation)
    with torch.no_grad():
        return model(IDS.to(model.device)).logits.float().cpu()
