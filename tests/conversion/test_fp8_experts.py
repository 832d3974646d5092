"""A DeepSeek-V3-style FP8 MoE checkpoint becomes a 4-bit checkpoint, experts included, in one command: converting it
with `--quantize-experts` equals, byte for byte, converting the 16-bit checkpoint DeepSeek's `weight_dequant` writes
from the same stored tensors (every linear weight FP8 with a 128x128-block scale, experts included, as DeepSeek-V3
publishes it; routers, norms and embeddings stay 16-bit)."""

from __future__ import annotations

import json
import re

import torch
from fp8_checkpoints import block_quantize, deepseek_weight_dequant, outputs, write_checkpoint
from moe_checkpoints import build_moe, read_all

import prequant
from prequant.checkpoint.reader import scan_files

FP8 = re.compile(r"model\.layers\.\d+\.(self_attn|mlp)\..*(proj|proj_with_mqa)\.weight")


def test_fp8_moe_with_quantized_experts_is_the_reference_dequantization_converted(tmp_path):
    bf16 = build_moe("deepseek_v3", tmp_path / "bf16")
    stored = read_all(bf16)
    config = json.loads((bf16 / "config.json").read_text())
    fp8: dict[str, torch.Tensor] = {}
    ref: dict[str, torch.Tensor] = {}
    scales: dict[str, torch.Tensor] = {}
    for name, w in stored.items():
        if FP8.fullmatch(name) and w.dim() == 2:
            q, s = block_quantize(w, (128, 128), torch.float32)
            fp8[name], ref[name] = q, deepseek_weight_dequant(q, s, torch.bfloat16, 128)
            scales[name.removesuffix(".weight") + ".weight_scale_inv"] = s
        else:
            fp8[name] = ref[name] = w
    assert any(".experts.3." in n for n in scales), "the experts are FP8 too"
    qc = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
    src = write_checkpoint(tmp_path / "fp8", [fp8 | scales], config | {"quantization_config": qc})
    reference = write_checkpoint(tmp_path / "ref", [ref], config)

    prequant.convert(src, tmp_path / "out-fp8", device="cpu", progress=False, quantize_experts=True)
    prequant.convert(reference, tmp_path / "out-ref", device="cpu", progress=False, quantize_experts=True)

    got, wanted = outputs(tmp_path / "out-fp8"), outputs(tmp_path / "out-ref")
    assert got.keys() == wanted.keys()
    for name in wanted:
        assert got[name] == wanted[name], name
    keys = {t.name for t in scan_files(sorted((tmp_path / "out-fp8").glob("*.safetensors")))}
    assert "model.layers.1.mlp.experts.3.down_proj.weight.absmax" in keys  # an expert, 4-bit
    assert not [k for k in keys if k.endswith("weight_scale_inv")]
    qc_out = json.loads((tmp_path / "out-fp8" / "config.json").read_text())["quantization_config"]
    assert qc_out["quant_method"] == "bitsandbytes"
