"""The synthetic checkpoints of the benchmarks: Llama-8B-, Grok-1- or uniform 32 MiB-tensor shapes, random bf16,
written shard by shard so that generating 30+ GB never holds more than one shard in memory; and the MoE shapes
Mixtral-8x7B and Qwen3-30B-A3B (bf16, transformers-native per-expert names as their Hub checkpoints store them) and
DeepSeek-V3 (block-scaled FP8 as published: every linear weight of attention and MLP float8_e4m3fn with a float32
`weight_scale_inv` per 128x128 block, random finite e4m3 codes; routers, norms and embeddings 16-bit).

`generate(..., model_code=True)` (Grok only) also writes the remote-code model of tests/grok/ beside the weights,
with an auto_map pointing to it: a checkpoint that transformers (trust_remote_code=True), `load_for_fsdp` and
check-fsdp can load, in keyfan/grok-1-hf naming, at Grok-1's real dimensions (or `dims` overrides).

`generated(shape, size_gb, work)` is the checkpoint convert.py and window.py measure, generated once under `work`.
The GPU machine's drivers (scripts/gpu/) generate theirs from the command line:

    python scripts/bench/synthetic.py OUT --shape llama --size-gb 16
    python scripts/bench/synthetic.py OUT --shape grok --layers 4 --model-code [--dims '{"hidden": 256}']
    python scripts/bench/synthetic.py OUT --shape deepseek_v3 --layers 2     # 1 dense + 1 MoE layer, FP8
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from pathlib import Path

from common import ROOT  # this directory

GROK_CODE = ROOT / "tests" / "grok"  # configuration_grok1.py, modeling_grok1.py

SHAPES = {
    # name: model dimensions; layer_tensors() and config_for() turn them into tensors and a config.json
    "llama": dict(hidden=4096, inter=14336, kv=1024, vocab=128256, heads=32, kv_heads=8),
    "grok": dict(hidden=6144, inter=32768, kv=1024, vocab=131072, heads=48, kv_heads=8, experts=8),
    "uniform": dict(hidden=4096, inter=4096, kv=4096, vocab=4096, heads=32, kv_heads=32),
    # MoE: `inter` is each expert's; `experts` routed experts, `active` of them per token
    "mixtral": dict(hidden=4096, inter=14336, kv=1024, vocab=32000, heads=32, kv_heads=8, experts=8, active=2),
    "qwen3_moe": dict(hidden=2048, inter=768, kv=512, vocab=151936, heads=32, kv_heads=4, head_dim=128, experts=128,
                      active=8),
    # layers [0, dense_layers) dense (MLP of dense_inter), the rest MoE with one shared expert; MLA attention
    "deepseek_v3": dict(hidden=7168, inter=2048, dense_inter=18432, vocab=129280, heads=128, experts=256, active=8,
                        groups=8, topk_groups=4, dense_layers=1, q_lora=1536, kv_lora=512, rope=64, nope=128,
                        v_head=128),
}
FP8_BLOCK = 128  # DeepSeek-V3's weight_block_size


def dims_for(shape: str, dims: dict | None = None) -> dict:
    """SHAPES[shape] with `dims` overriding some of its entries (kv follows hidden or head_dim, heads and kv_heads)."""
    c = {**SHAPES[shape], **(dims or {})}
    if dims and "kv" not in dims and "kv_heads" in c:
        c["kv"] = c["kv_heads"] * c.get("head_dim", c["hidden"] // c["heads"])
    return c


def is_fp8(shape: str, name: str, s: tuple[int, ...]) -> bool:
    """Whether DeepSeek-V3 stores this tensor in float8: every 2-D weight of attention and MLP but the router."""
    return (shape == "deepseek_v3" and len(s) == 2 and ".layers." in name and not name.endswith(".mlp.gate.weight"))


def stored(shape: str, name: str, s: tuple[int, ...]) -> list[tuple[str, tuple[int, ...], str]]:
    """The tensors one model tensor is stored as, (name, shape, dtype): itself in bf16, or (FP8) its float8 codes
    and their float32 block scales; the router's correction bias float32, as DeepSeek-V3 publishes it."""
    if is_fp8(shape, name, s):
        blocks = tuple(-(-d // FP8_BLOCK) for d in s)
        return [(name, s, "float8_e4m3fn"), (name.removesuffix(".weight") + ".weight_scale_inv", blocks, "float32")]
    return [(name, s, "float32" if name.endswith("e_score_correction_bias") else "bfloat16")]


def nbytes(s: tuple[int, ...], dtype: str) -> int:
    return math.prod(s) * {"float8_e4m3fn": 1, "float32": 4}.get(dtype, 2)


def layer_tensors(shape: str, i: int, dims: dict | None = None) -> list[tuple[str, tuple[int, ...]]]:
    c = dims_for(shape, dims)
    h, f, kv = c["hidden"], c["inter"], c.get("kv", 0)
    if shape == "grok":  # keyfan/grok-1-hf naming; quantized by prequant's name rules
        p = f"transformer.decoder_layer.{i}"
        out = [(f"{p}.multi_head_attention.{n}.weight", s) for n, s in
               (("query", (h, h)), ("key", (kv, h)), ("value", (kv, h)), ("linear", (h, h)))]
        out.append((f"{p}.router.weight", (c["experts"], h)))
        for e in range(c["experts"]):
            out += [(f"{p}.moe.{e}.linear.weight", (f, h)), (f"{p}.moe.{e}.linear_v.weight", (f, h)),
                    (f"{p}.moe.{e}.linear_1.weight", (h, f))]
        out += [(f"{p}.{n}.weight", (h,)) for n in ("rms_norm", "rms_norm_1", "rms_norm_2", "rms_norm_3")]
        return out
    p = f"model.layers.{i}"
    norms = [(f"{p}.input_layernorm.weight", (h,)), (f"{p}.post_attention_layernorm.weight", (h,))]
    if shape == "mixtral":  # Mixtral's Hub naming: block_sparse_moe, w1 (gate) / w3 (up) / w2 (down)
        m = f"{p}.block_sparse_moe"
        experts = [(f"{m}.experts.{e}.{n}.weight", s) for e in range(c["experts"])
                   for n, s in (("w1", (f, h)), ("w2", (h, f)), ("w3", (f, h)))]
        return [*_attention(p, h, h, kv), (f"{m}.gate.weight", (c["experts"], h)), *experts, *norms]
    if shape == "qwen3_moe":
        heads = c["heads"] * c["head_dim"]
        qk_norms = [(f"{p}.self_attn.{n}.weight", (c["head_dim"],)) for n in ("q_norm", "k_norm")]
        return [*_attention(p, h, heads, kv), *qk_norms, (f"{p}.mlp.gate.weight", (c["experts"], h)),
                *_mlp(f"{p}.mlp.experts", f, h, c["experts"]), *norms]
    if shape == "deepseek_v3":
        a, n = f"{p}.self_attn", c["heads"]
        attention = [(f"{a}.q_a_proj.weight", (c["q_lora"], h)), (f"{a}.q_a_layernorm.weight", (c["q_lora"],)),
                     (f"{a}.q_b_proj.weight", (n * (c["nope"] + c["rope"]), c["q_lora"])),
                     (f"{a}.kv_a_proj_with_mqa.weight", (c["kv_lora"] + c["rope"], h)),
                     (f"{a}.kv_a_layernorm.weight", (c["kv_lora"],)),
                     (f"{a}.kv_b_proj.weight", (n * (c["nope"] + c["v_head"]), c["kv_lora"])),
                     (f"{a}.o_proj.weight", (h, n * c["v_head"]))]
        if i < c["dense_layers"]:
            return [*attention, *_mlp(f"{p}.mlp", c["dense_inter"], h), *norms]
        router = [(f"{p}.mlp.gate.weight", (c["experts"], h)),
                  (f"{p}.mlp.gate.e_score_correction_bias", (c["experts"],))]
        return [*attention, *router, *_mlp(f"{p}.mlp.experts", f, h, c["experts"]),
                *_mlp(f"{p}.mlp.shared_experts", f, h), *norms]
    return [
        (f"{p}.self_attn.q_proj.weight", (h, h)), (f"{p}.self_attn.k_proj.weight", (kv, h)),
        (f"{p}.self_attn.v_proj.weight", (kv, h)), (f"{p}.self_attn.o_proj.weight", (h, h)),
        (f"{p}.mlp.gate_proj.weight", (f, h)), (f"{p}.mlp.up_proj.weight", (f, h)),
        (f"{p}.mlp.down_proj.weight", (h, f)),
        (f"{p}.input_layernorm.weight", (h,)), (f"{p}.post_attention_layernorm.weight", (h,)),
    ]


def _attention(p: str, h: int, heads: int, kv: int) -> list[tuple[str, tuple[int, ...]]]:
    a = f"{p}.self_attn"
    return [(f"{a}.q_proj.weight", (heads, h)), (f"{a}.k_proj.weight", (kv, h)), (f"{a}.v_proj.weight", (kv, h)),
            (f"{a}.o_proj.weight", (h, heads))]


def _mlp(p: str, f: int, h: int, experts: int | None = None) -> list[tuple[str, tuple[int, ...]]]:
    """gate/up/down projections at `p`, or at `p`.E for each of `experts` experts."""
    prefixes = [p] if experts is None else [f"{p}.{e}" for e in range(experts)]
    return [(f"{q}.{n}.weight", s) for q in prefixes for n, s in (("gate_proj", (f, h)), ("up_proj", (f, h)),
                                                                  ("down_proj", (h, f)))]


def config_for(shape: str, layers: int, dims: dict | None = None, model_code: bool = False) -> dict:
    c = dims_for(shape, dims)
    common = {"hidden_size": c["hidden"], "num_hidden_layers": layers, "num_attention_heads": c["heads"],
              "vocab_size": c["vocab"], "num_experts_per_tok": c.get("active"), "tie_word_embeddings": False,
              "torch_dtype": "bfloat16", "hidden_act": "silu", "max_position_embeddings": 8192}
    if shape == "mixtral":
        return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", **common,
                "intermediate_size": c["inter"], "num_key_value_heads": c["kv_heads"],
                "num_local_experts": c["experts"], "rms_norm_eps": 1e-5, "rope_theta": 1e6,
                "router_aux_loss_coef": 0.02}
    if shape == "qwen3_moe":
        return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", **common,
                "intermediate_size": 8 * c["inter"], "moe_intermediate_size": c["inter"],
                "num_key_value_heads": c["kv_heads"], "head_dim": c["head_dim"], "num_experts": c["experts"],
                "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True, "rms_norm_eps": 1e-6,
                "rope_theta": 1e6, "attention_bias": False}
    if shape == "deepseek_v3":  # DeepSeek-V3's own config.json, its FP8 declaration included
        return {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", **common,
                "intermediate_size": c["dense_inter"], "moe_intermediate_size": c["inter"],
                "num_key_value_heads": c["heads"], "n_routed_experts": c["experts"], "n_shared_experts": 1,
                "n_group": c["groups"], "topk_group": c["topk_groups"], "routed_scaling_factor": 2.5,
                "first_k_dense_replace": c["dense_layers"], "moe_layer_freq": 1, "norm_topk_prob": True,
                "scoring_func": "sigmoid", "topk_method": "noaux_tc", "q_lora_rank": c["q_lora"],
                "kv_lora_rank": c["kv_lora"], "qk_rope_head_dim": c["rope"], "qk_nope_head_dim": c["nope"],
                "v_head_dim": c["v_head"], "rms_norm_eps": 1e-6, "rope_theta": 10000, "attention_bias": False,
                "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                        "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}}
    if shape == "grok":
        auto_map = {"AutoModelForCausalLM": "modeling_grok1.Grok1ModelForCausalLM"}
        code = {"auto_map": {"AutoConfig": "configuration_grok1.Grok1Config", **auto_map}, "naming": "keyfan",
                "rms_norm_eps": 1e-5, "tie_word_embeddings": False} if model_code else {"auto_map": auto_map}
        return {"architectures": ["Grok1ModelForCausalLM"], "model_type": "grok-1", **code,
                "hidden_size": c["hidden"], "intermediate_size": c["inter"], "num_hidden_layers": layers,
                "num_attention_heads": c["heads"], "num_key_value_heads": c["kv_heads"], "vocab_size": c["vocab"],
                "num_experts": c["experts"], "num_experts_per_tok": 2, "torch_dtype": "bfloat16"}
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": c["hidden"],
            "intermediate_size": c["inter"], "num_hidden_layers": layers, "num_attention_heads": c["heads"],
            "num_key_value_heads": c["kv_heads"], "vocab_size": c["vocab"], "head_dim": c["hidden"] // c["heads"],
            "rms_norm_eps": 1e-5, "max_position_embeddings": 8192, "tie_word_embeddings": False,
            "torch_dtype": "bfloat16", "hidden_act": "silu"}


def sizes(shape: str, dims: dict | None = None) -> tuple[int, int]:
    """(bytes of one decoder layer as stored, the last one for a shape with dense layers first; bf16 bytes of the
    rest: embedding, head, final norm)."""
    c = dims_for(shape, dims)
    i = c.get("dense_layers", 0)
    per_layer = sum(nbytes(s2, d) for n, s in layer_tensors(shape, i, dims) for _, s2, d in stored(shape, n, s))
    return per_layer, 2 * (2 * c["vocab"] * c["hidden"] + c["hidden"])


WEIGHTS = {  # fmt: (shard name pattern, index name), as transformers names them
    "safetensors": ("model-{i:05d}-of-{n:05d}.safetensors", "model.safetensors.index.json"),
    "bin": ("pytorch_model-{i:05d}-of-{n:05d}.bin", "pytorch_model.bin.index.json"),  # keyfan/grok-1-hf's
}


def generate(shape: str, size_gb: float, out: Path, shard_gb: float = 5.0, *, layers: int | None = None,
             dims: dict | None = None, model_code: bool = False, fmt: str = "safetensors") -> Path:
    """Write a random checkpoint (bf16; DeepSeek-V3 FP8) of about size_gb (or of `layers` decoder layers), shard by
    shard (one shard in memory at a time). `dims` overrides SHAPES[shape]'s entries; `model_code` (grok) adds the
    remote-code model; `fmt` "bin" writes PyTorch pickle shards (torch.save) instead of safetensors."""
    import torch
    from safetensors.torch import save_file

    if model_code and shape != "grok":
        raise ValueError("model_code: only the grok shape has model code (tests/grok/)")
    c = dims_for(shape, dims)
    embed = [("model.embed_tokens.weight" if shape != "grok" else "transformer.in_out_embed.weight",
              (c["vocab"], c["hidden"]))]
    head = [("lm_head.weight", (c["vocab"], c["hidden"])),
            ("model.norm.weight" if shape != "grok" else "transformer.rms_norm.weight", (c["hidden"],))]
    per_layer, fixed = sizes(shape, dims)
    layers = layers or max(1, round((size_gb * 1e9 - fixed) / per_layer))
    model = embed + [t for i in range(layers) for t in layer_tensors(shape, i, dims)] + head
    tensors = [t for n, s in model for t in stored(shape, n, s)]
    out.mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shards: list[list[tuple[str, tuple[int, ...], str]]] = [[]]
    used = 0
    for name, s, dtype in tensors:
        size = nbytes(s, dtype)
        if used and used + size > shard_gb * 1e9 and not name.endswith("_scale_inv"):  # a scale beside its weight
            shards.append([])
            used = 0
        shards[-1].append((name, s, dtype))
        used += size
    weight_map, gen = {}, torch.Generator(device).manual_seed(0)
    pattern, index = WEIGHTS[fmt]

    def random(s: tuple[int, ...], dtype: str) -> torch.Tensor:
        if dtype == "float8_e4m3fn":  # any code but the NaNs 0x7f and 0xff: 0..253 -> 0..126, 128..254
            v = torch.randint(0, 254, s, generator=gen, device=device, dtype=torch.uint8)
            return (v + (v >= 127).to(torch.uint8)).view(torch.float8_e4m3fn)
        if s and len(s) == 2 and dtype == "float32":  # block scales: positive
            return torch.rand(s, generator=gen, device=device) * 2e-4 + 1e-5
        return (torch.randn(s, generator=gen, device=device, dtype=torch.float32) * 0.02).to(getattr(torch, dtype))

    for i, shard in enumerate(shards):
        fname = pattern.format(i=i + 1, n=len(shards))
        data = {n: random(s, dtype).cpu() for n, s, dtype in shard}
        if fmt == "bin":
            torch.save(data, out / fname)
        else:
            save_file(data, out / fname, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(data, fname))
        del data
    total = sum(nbytes(s, dtype) for _, s, dtype in tensors)
    (out / index).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (out / "config.json").write_text(json.dumps(config_for(shape, layers, dims, model_code), indent=2))
    if model_code:
        for name in ("configuration_grok1.py", "modeling_grok1.py"):
            shutil.copy(GROK_CODE / name, out / name)
    return out


def source_arguments(ap: argparse.ArgumentParser) -> None:
    """--size-gb, --shape and --dir (where it is generated, and the benchmark's scratch): the source to measure."""
    ap.add_argument("--size-gb", type=float, default=16)
    ap.add_argument("--shape", choices=list(SHAPES), default="llama")
    ap.add_argument("--dir", type=Path, default=Path("/tmp/prequant-bench"))
    ap.add_argument("--layers", type=int, help="this many decoder layers, whatever --size-gb")
    ap.add_argument("--dims", type=json.loads, default=None, metavar="JSON",
                    help="entries of the shape's dimensions to override (smoke runs at reduced size)")


def generated(shape: str, size_gb: float, work: Path, layers: int | None = None, dims: dict | None = None,
              shard_gb: float = 5.0) -> Path:
    """work/SHAPE-SIZEgb (or -Nlayers), generated unless a checkpoint is already there (the benchmarks' source)."""
    src = work / (f"{shape}-{layers}layers" if layers else f"{shape}-{size_gb:g}gb")
    if not (src / "config.json").exists():
        _generate_timed(shape, size_gb, src, layers=layers, dims=dims, shard_gb=shard_gb)
    return src


def _generate_timed(shape: str, size_gb: float, out: Path, **kwargs) -> Path:
    t = time.monotonic()  # on the GPU when there is one (generate)
    generate(shape, size_gb, out, **kwargs)
    size = sum(f.stat().st_size for f in out.iterdir() if f.suffix in (".safetensors", ".bin"))
    print(f"generated {out}: {size / 1e9:.2f} GB in {time.monotonic() - t:.0f}s", file=sys.stderr)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("output", type=Path)
    ap.add_argument("--shape", choices=list(SHAPES), default="llama")
    ap.add_argument("--size-gb", type=float, default=0, help="about this many GB (or --layers)")
    ap.add_argument("--layers", type=int, help="this many decoder layers, whatever the size")
    ap.add_argument("--dims", type=json.loads, default=None, metavar="JSON",
                    help="entries of SHAPES[shape] to override, e.g. '{\"hidden\": 256, \"heads\": 8}'")
    ap.add_argument("--model-code", action="store_true", help="grok: the remote-code model of tests/grok/ beside it")
    ap.add_argument("--format", choices=list(WEIGHTS), default="safetensors", help="safetensors, or PyTorch .bin shards")
    args = ap.parse_args()
    if not args.size_gb and not args.layers:
        ap.error("give --size-gb or --layers")
    _generate_timed(args.shape, args.size_gb, args.output, layers=args.layers, dims=args.dims or None,
                    model_code=args.model_code, fmt=args.format)


if __name__ == "__main__":
    main()
