"""Tiny checkpoints stored as the INT4 and MXFP4 giants are published, each with the 16-bit checkpoint its format's own
reference dequantization writes from the same stored tensors.

- INT4 (moonshotai/Kimi-K2-Thinking): a DeepSeek-V3-architecture MoE whose routed experts are compressed-tensors
  `pack-quantized` (`weight_packed` int32, `weight_scale` bf16, `weight_shape` int64, asymmetric schemes a packed
  `weight_zero_point`), everything else bf16 and listed in `ignore`, with Kimi's `quantization_config`. Written and
  read back by compressed-tensors' own `PackedQuantizationCompressor` (compress, decompress), the scales from its
  `calculate_qparams`; the reference is its decompressed weight in the model's dtype, as transformers loads it.
- MXFP4 (openai/gpt-oss-20b): a gpt-oss whose fused experts are `*_blocks` uint8 [E, R, G, 16] and `*_scales` uint8
  [E, R, G] (random codes, exponents around 127), biases and every other tensor bf16, with gpt-oss's
  `quantization_config`. The reference is transformers' own: `from_pretrained(src, quantization_config=
  Mxfp4Config(dequantize=True))` on the CPU, then `save_pretrained`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from fp8_checkpoints import write_checkpoint
from moe_checkpoints import build_moe, read_all

KIMI_IGNORE = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"]
GPT_OSS_QC = {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                         "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"}


def kimi_qc(strategy: str = "group", symmetric: bool = True, group_size: int = 32) -> dict:
    """Kimi-K2-Thinking's `quantization_config` (its scheme changeable, for the other strategies and symmetry)."""
    weights = {"actorder": None, "block_structure": None, "dynamic": False,
               "group_size": group_size if strategy == "group" else None, "num_bits": 4, "observer": "minmax",
               "observer_kwargs": {}, "strategy": strategy, "symmetric": symmetric, "type": "int"}
    return {"config_groups": {"group_0": {"input_activations": None, "output_activations": None,
                                          "targets": ["Linear"], "weights": weights}},
            "format": "pack-quantized", "ignore": KIMI_IGNORE, "kv_cache_scheme": None,
            "quant_method": "compressed-tensors", "quantization_status": "compressed"}


def int4_compress(w: torch.Tensor, qc: dict) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(compressed-tensors' stored tensors of weight `w` under `qc`'s scheme, its decompression as it loads: the
    weight in the scale's dtype)."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams

    weights = qc["config_groups"]["group_0"]["weights"]
    args = QuantizationArgs(**{k: v for k, v in weights.items() if k not in ("observer", "observer_kwargs")})
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    x = {"group": lambda: w.unflatten(-1, (-1, args.group_size)), "channel": lambda: w.reshape(w.shape[0], 1, -1),
         "tensor": lambda: w.reshape(1, -1)}[args.strategy]()
    scale, zero_point = calculate_qparams(x.amin(-1), x.amax(-1), args)
    stored = PackedQuantizationCompressor.compress({"weight": w, "weight_scale": scale,
                                                    "weight_zero_point": zero_point}, scheme)
    return stored, PackedQuantizationCompressor.decompress(dict(stored), scheme)["weight"]


def is_routed_expert(name: str) -> bool:
    return ".mlp.experts." in name and name.endswith(".weight")


def int4_pair(root: Path, qc: dict | None = None, seed: int = 0) -> tuple[Path, Path]:
    """(a Kimi-K2-style INT4 checkpoint, the 16-bit checkpoint compressed-tensors' decompression makes of it), both in
    two shards, the same tensors in the same order: each routed expert's `weight_packed` in the place of its weight,
    its scale, shape and zero point at the end of its shard (layer 1 expert 0's gate_proj scale in the other one)."""
    qc = qc or kimi_qc()
    bf16 = build_moe("deepseek_v3", root / "bf16", seed=seed)
    stored, config = read_all(bf16), json.loads((bf16 / "config.json").read_text())
    names = list(stored)
    half = len(names) // 2
    src: list[dict[str, torch.Tensor]] = [{}, {}]
    ref: list[dict[str, torch.Tensor]] = [{}, {}]
    extra: list[dict[str, torch.Tensor]] = [{}, {}]
    for i, name in enumerate(names):
        shard, w = (0 if i < half else 1), stored[name]
        if not is_routed_expert(name):
            src[shard][name] = ref[shard][name] = w
            continue
        parts, dequantized = int4_compress(w, qc)
        module = name.removesuffix(".weight")
        src[shard][module + ".weight_packed"] = parts.pop("weight_packed")
        ref[shard][name] = dequantized.to(torch.bfloat16)
        other = 1 - shard if module == "model.layers.1.mlp.experts.0.gate_proj" else shard
        extra[other].update({f"{module}.{k}": v for k, v in parts.items()})
    for shard in (0, 1):  # larger elements first: every tensor aligned
        for name in sorted(extra[shard], key=lambda n: -extra[shard][n].element_size()):
            src[shard][name] = extra[shard][name]
    return (write_checkpoint(root / "int4", src, config | {"quantization_config": qc}),
            write_checkpoint(root / "int4-ref", ref, config))


def mxfp4_source(root: Path, seed: int = 0) -> Path:
    """A gpt-oss-20b-style MXFP4 checkpoint: a tiny bf16 gpt-oss whose fused experts are stored as gpt-oss stores
    them, `X_blocks` [E, R, G, 16] and `X_scales` [E, R, G] in the place of `X`, from random codes and exponents."""
    bf16 = build_moe("gpt_oss", root / "gpt-oss-bf16", seed=seed)
    stored, config = read_all(bf16), json.loads((bf16 / "config.json").read_text())
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, w in stored.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            experts, cols, rows = w.shape  # transformers holds [E, in, out]; the checkpoint stores [E, out, in / 32]
            out[name + "_blocks"] = torch.randint(0, 256, (experts, rows, cols // 32, 16), generator=g,
                                                  dtype=torch.uint8)
            out[name + "_scales"] = torch.randint(120, 131, (experts, rows, cols // 32), generator=g,
                                                  dtype=torch.uint8)
        else:
            out[name] = w
    return write_checkpoint(root / "mxfp4", [out], config | {"quantization_config": GPT_OSS_QC})


def mxfp4_reference(src: Path, out: Path) -> Path:
    """transformers' dequantization of an MXFP4 checkpoint: loaded with `Mxfp4Config(dequantize=True)` on the CPU,
    saved as the 16-bit checkpoint it holds."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    model = AutoModelForCausalLM.from_pretrained(src, quantization_config=Mxfp4Config(dequantize=True),
                                                 device_map="cpu")
    model.save_pretrained(out)
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config, "transformers saves the dequantized model as a 16-bit one"
    (out / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 64}))
    return out
