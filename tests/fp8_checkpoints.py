"""Tiny FP8 checkpoints of both formats prequant reads, built from a tiny Llama whose dimensions are not multiples of
128, and the 16-bit checkpoint each reference dequantization writes from the same stored tensors.

The references, written here from their definitions:
- DeepSeek-V3's `weight_dequant` (inference/kernel.py, `weight_dequant_kernel`): per 128x128 block (masked at the
  edges, so edge blocks are partial) `x = load(x).to(float32); s = load(s_ptr + pid_m * n + pid_n); y = x * s`, stored
  into `torch.empty_like(x, dtype=torch.get_default_dtype())`, the model's dtype.
- compressed-tensors' `FloatQuantizationCompressor.decompress_weight` (compressors/quantized_compressors/
  naive_quantized.py) calls `dequantize(x_q, scale)` (quantization/lifecycle/forward.py), which for the tensor and
  channel strategies is `_dequantize`: `x_q.to(scale.dtype) * scale`, in the scale's dtype; loading casts it to the
  model's dtype.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import torch

HIDDEN, INTERMEDIATE = 160, 272  # not multiples of 128: partial edge blocks
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
E4M3_MAX = 448.0
CODES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.float8_e4m3fn: "F8_E4M3",
         torch.float8_e5m2: "F8_E5M2", torch.int64: "I64", torch.int32: "I32", torch.uint8: "U8"}


def llama_state(seed: int = 0) -> tuple[dict[str, torch.Tensor], dict]:
    """A tiny bf16 Llama's state dict, in the model's order, and its config.json."""
    import transformers as tf

    torch.manual_seed(seed)
    config = tf.LlamaConfig(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, vocab_size=256)
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():  # weights of varied magnitudes: scales that differ block to block
            p.mul_(torch.rand(()) * 4 + 0.5)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, model.config.to_diff_dict() | {
        "dtype": "bfloat16"}


def is_linear(name: str) -> bool:
    return name.startswith("model.layers.") and name.rsplit(".", 2)[-2] in LINEARS and name.endswith(".weight")


# ---------------------------------------------------------------------------------------------- quantizing


def block_quantize(w: torch.Tensor, block: tuple[int, int],
                   scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """float8 e4m3 codes and one scale per block (partial at the edges), DeepSeek's layout: w ~ codes * scale."""
    rows, cols = w.shape
    nr, nc = math.ceil(rows / block[0]), math.ceil(cols / block[1])
    scale = torch.empty(nr, nc, dtype=scale_dtype)
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(nr):
        for j in range(nc):
            part = w[i * block[0] : (i + 1) * block[0], j * block[1] : (j + 1) * block[1]].float()
            scale[i, j] = part.abs().max() / E4M3_MAX
            s = scale[i, j].float()
            q[i * block[0] : (i + 1) * block[0], j * block[1] : (j + 1) * block[1]] = (part / s).clamp(
                -E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale


def ct_quantize(w: torch.Tensor, per: str, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """compressed-tensors FP8 codes and scale: per "tensor" (shape (1,)) or per "channel" ([rows, 1])."""
    x = w.float()
    amax = x.abs().amax(dim=1, keepdim=True) if per == "channel" else x.abs().max().reshape(1)
    scale = (amax / E4M3_MAX).to(scale_dtype)
    return (x / scale.float()).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


# ---------------------------------------------------------------------------------------------- the references


def deepseek_weight_dequant(x: torch.Tensor, s: torch.Tensor, dtype: torch.dtype,
                            block_size: int = 128) -> torch.Tensor:
    """DeepSeek-V3's weight_dequant, block by block as its Triton kernel runs (module docstring)."""
    rows, cols = x.shape
    y = torch.empty(rows, cols, dtype=dtype)
    for pid_m in range(math.ceil(rows / block_size)):
        for pid_n in range(math.ceil(cols / block_size)):
            r = slice(pid_m * block_size, (pid_m + 1) * block_size)
            c = slice(pid_n * block_size, (pid_n + 1) * block_size)
            y[r, c] = x[r, c].to(torch.float32) * s[pid_m, pid_n].to(torch.float32)  # the store rounds to y's dtype
    return y


def ct_dequantize(x_q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """compressed-tensors' _dequantize for the tensor and channel strategies, then the model's dtype on load."""
    return (x_q.to(scale.dtype) * scale).to(dtype)


# ---------------------------------------------------------------------------------------------- writing


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """A safetensors file holding `tensors` in this order (safetensors' own writer sorts them, which would give the
    FP8 checkpoint and its 16-bit reference different orders); each tensor aligned to its element size."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset, blobs = 0, []
    for name, t in tensors.items():
        t = t.contiguous()
        assert offset % t.element_size() == 0, f"{name} would be misaligned"
        data = t.reshape(-1).view(torch.uint8).numpy().tobytes()
        header[name] = {"dtype": CODES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def write_checkpoint(path: Path, shards: list[dict[str, torch.Tensor]], config: dict) -> Path:
    """A checkpoint of these shards (model-0000i-of-0000n.safetensors with an index when more than one)."""
    path.mkdir(parents=True, exist_ok=True)
    names = ["model.safetensors"] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for name, tensors in zip(names, shards):
        write_safetensors(path / name, tensors)
    if len(shards) > 1:
        weight_map = {k: name for name, tensors in zip(names, shards) for k in tensors}
        (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps(config, indent=2))
    (path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 64}))
    return path


def fp8_pair(root: Path, fmt: str, scale_dtype: torch.dtype, *, seed: int = 0,
             block: tuple[int, int] = (128, 128)) -> tuple[Path, Path]:
    """(an FP8 checkpoint, the 16-bit checkpoint its reference dequantization writes), both in two shards, the same
    tensors in the same order. `fmt`: "block" (DeepSeek's format), "channel" or "tensor" (compressed-tensors', with an
    input_scale per module and a KV-cache scale of no FP8 module). Layer 0's q_proj scale sits in the second shard
    and layer 1's o_proj scale in the first: a weight and its scale in different shards, both ways."""
    state, config = llama_state(seed)
    names = list(state)
    half = len(names) // 2
    weights = [dict(), dict()]  # the 16-bit reference's tensors, per shard, in order
    fp8 = [dict(), dict()]
    extra: list[dict[str, torch.Tensor]] = [dict(), dict()]  # scales and activation parameters: at each shard's end
    for i, name in enumerate(names):
        shard = 0 if i < half else 1
        w = state[name]
        if not is_linear(name):
            weights[shard][name] = fp8[shard][name] = w
            continue
        module = name.removesuffix(".weight")
        if fmt == "block":
            q, s = block_quantize(w, block, scale_dtype)
            scale_name, ref = module + ".weight_scale_inv", deepseek_weight_dequant(q, s, torch.bfloat16, block[0])
        else:
            q, s = ct_quantize(w, fmt, scale_dtype)
            scale_name, ref = module + ".weight_scale", ct_dequantize(q, s, torch.bfloat16)
            extra[shard][module + ".input_scale"] = torch.rand(1, dtype=torch.float32)
        fp8[shard][name], weights[shard][name] = q, ref
        other = {"model.layers.0.self_attn.q_proj": 1, "model.layers.1.self_attn.o_proj": 0}.get(module, shard)
        extra[other][scale_name] = s
    if fmt != "block":
        extra[1]["model.layers.1.self_attn.k_scale"] = torch.ones((), dtype=torch.float32)
    for shard in (0, 1):  # larger elements first: every tensor aligned
        for name in sorted(extra[shard], key=lambda n: -extra[shard][n].element_size()):
            fp8[shard][name] = extra[shard][name]
    if fmt == "block":
        qc = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": list(block)}
    else:
        scheme = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": fmt}
        qc = {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
              "config_groups": {"group_0": {"targets": ["Linear"], "weights": scheme,
                                            "input_activations": {**scheme, "strategy": "tensor"}}},
              "ignore": ["lm_head"], "kv_cache_scheme": None}
    src = write_checkpoint(root / f"{fmt}-fp8", fp8, config | {"quantization_config": qc})
    ref = write_checkpoint(root / f"{fmt}-ref", weights, config)
    return src, ref


def outputs(folder: Path) -> dict[str, bytes]:
    """Every output file but the two that describe the source (manifest, card)."""
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.name not in ("prequant.json", "README.md")}
