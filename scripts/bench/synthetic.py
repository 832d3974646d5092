"""The synthetic checkpoints of the benchmarks: Llama-8B-, Grok-1- or uniform 32 MiB-tensor shapes, random bf16,
written shard by shard so that generating 30+ GB never holds more than one shard in memory.

`generate(..., model_code=True)` (Grok only) also writes the remote-code model of tests/grok/ beside the weights,
with an auto_map pointing to it: a checkpoint that transformers (trust_remote_code=True), `load_for_fsdp` and
check-fsdp can load, in keyfan/grok-1-hf naming, at Grok-1's real dimensions (or `dims` overrides).

`generated(shape, size_gb, work)` is the checkpoint convert.py and window.py measure, generated once under `work`.
The GPU machine's drivers (scripts/gpu/) generate theirs from the command line:

    python scripts/bench/synthetic.py OUT --shape llama --size-gb 16
    python scripts/bench/synthetic.py OUT --shape grok --layers 4 --model-code [--dims '{"hidden": 256}']
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
}


def dims_for(shape: str, dims: dict | None = None) -> dict:
    """SHAPES[shape] with `dims` overriding some of its entries (kv follows hidden, heads and kv_heads)."""
    c = {**SHAPES[shape], **(dims or {})}
    if dims and "kv" not in dims:
        c["kv"] = c["kv_heads"] * (c["hidden"] // c["heads"])
    return c


def layer_tensors(shape: str, i: int, dims: dict | None = None) -> list[tuple[str, tuple[int, ...]]]:
    c = dims_for(shape, dims)
    h, f, kv = c["hidden"], c["inter"], c["kv"]
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
    return [
        (f"{p}.self_attn.q_proj.weight", (h, h)), (f"{p}.self_attn.k_proj.weight", (kv, h)),
        (f"{p}.self_attn.v_proj.weight", (kv, h)), (f"{p}.self_attn.o_proj.weight", (h, h)),
        (f"{p}.mlp.gate_proj.weight", (f, h)), (f"{p}.mlp.up_proj.weight", (f, h)),
        (f"{p}.mlp.down_proj.weight", (h, f)),
        (f"{p}.input_layernorm.weight", (h,)), (f"{p}.post_attention_layernorm.weight", (h,)),
    ]


def config_for(shape: str, layers: int, dims: dict | None = None, model_code: bool = False) -> dict:
    c = dims_for(shape, dims)
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
    """(bf16 bytes of one decoder layer, bf16 bytes of the rest: embedding, head, final norm)."""
    c = dims_for(shape, dims)
    per_layer = sum(2 * math.prod(s) for _, s in layer_tensors(shape, 0, dims))
    return per_layer, 2 * (2 * c["vocab"] * c["hidden"] + c["hidden"])


WEIGHTS = {  # fmt: (shard name pattern, index name), as transformers names them
    "safetensors": ("model-{i:05d}-of-{n:05d}.safetensors", "model.safetensors.index.json"),
    "bin": ("pytorch_model-{i:05d}-of-{n:05d}.bin", "pytorch_model.bin.index.json"),  # keyfan/grok-1-hf's
}


def generate(shape: str, size_gb: float, out: Path, shard_gb: float = 5.0, *, layers: int | None = None,
             dims: dict | None = None, model_code: bool = False, fmt: str = "safetensors") -> Path:
    """Write a random bf16 checkpoint of about size_gb (or of `layers` decoder layers), shard by shard (one shard in
    memory at a time). `dims` overrides SHAPES[shape]'s entries; `model_code` (grok) adds the remote-code model;
    `fmt` "bin" writes PyTorch pickle shards (torch.save) instead of safetensors."""
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
    tensors = embed + [t for i in range(layers) for t in layer_tensors(shape, i, dims)] + head
    out.mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    used = 0
    for name, s in tensors:
        nbytes = 2 * math.prod(s)
        if used and used + nbytes > shard_gb * 1e9:
            shards.append([])
            used = 0
        shards[-1].append((name, s))
        used += nbytes
    weight_map, gen = {}, torch.Generator(device).manual_seed(0)
    pattern, index = WEIGHTS[fmt]
    for i, shard in enumerate(shards):
        fname = pattern.format(i=i + 1, n=len(shards))
        data = {n: (torch.randn(s, generator=gen, device=device, dtype=torch.float32) * 0.02).to(torch.bfloat16).cpu()
                for n, s in shard}
        if fmt == "bin":
            torch.save(data, out / fname)
        else:
            save_file(data, out / fname, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(data, fname))
        del data
    total = sum(2 * math.prod(s) for _, s in tensors)
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


def generated(shape: str, size_gb: float, work: Path) -> Path:
    """work/SHAPE-SIZEgb, generated unless a checkpoint is already there (the benchmarks' source)."""
    src = work / f"{shape}-{size_gb:g}gb"
    if not (src / "config.json").exists():
        _generate_timed(shape, size_gb, src)
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
