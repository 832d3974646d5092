"""Grok-1-style MoE checkpoints (remote code, PyTorch .bin shards) in both published namings."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import Evil, build_grok, read_checkpoint, run_cli

import prequant

EXPERT = {"keyfan": "transformer.decoder_layer.0.moe.1.linear_v.weight", "hpcai": "model.layers.0.moe_block.experts.1.linear_v.weight"}
ATTN = {"keyfan": "transformer.decoder_layer.1.multi_head_attention.query.weight", "hpcai": "model.layers.1.attn.q_proj.weight"}
ROUTER = {"keyfan": "transformer.decoder_layer.0.router.weight", "hpcai": "model.layers.0.moe_block.gate.weight"}
EMBED = {"keyfan": "transformer.in_out_embed.weight", "hpcai": "model.embed_tokens.weight"}


@pytest.fixture(scope="module", params=["keyfan", "hpcai"])
def grok(request, tmp_path_factory):
    """(naming, source, output, sentinel file) with the conversion done by the CLI, code never trusted."""
    naming = request.param
    base = tmp_path_factory.mktemp(f"grok-{naming}")
    # Distinct directory names: transformers caches remote code modules under the directory's name.
    src = build_grok(base / f"src-{naming}", naming)
    sentinel = base / "sentinel.txt"
    out = base / f"out-{naming}"
    proc = run_cli("convert", str(src), str(out), "--device", "cpu", "--json", env={"GROK_SENTINEL": str(sentinel)})
    assert proc.returncode == 0, proc.stderr
    return naming, src, out, sentinel


def test_conversion_never_runs_checkpoint_code(grok):
    _, _, out, sentinel = grok
    assert (out / "config.json").exists()
    assert not sentinel.exists()


def test_experts_and_attention_quantized_router_embeddings_head_kept(grok):
    naming, _, out, _ = grok
    tensors = read_checkpoint(out)
    assert f"{EXPERT[naming]}.absmax" in tensors and f"{ATTN[naming]}.absmax" in tensors
    for kept in (ROUTER[naming], EMBED[naming], "lm_head.weight"):
        assert kept in tensors and f"{kept}.absmax" not in tensors
        assert tensors[kept].dtype == torch.bfloat16


def test_config_keeps_auto_map_and_skips_router_and_head(grok):
    naming, src, out, _ = grok
    config = json.loads((out / "config.json").read_text())
    assert config["auto_map"] == json.loads((src / "config.json").read_text())["auto_map"]
    skip = config["quantization_config"]["llm_int8_skip_modules"]
    assert "lm_head" in skip and ("router" if naming == "keyfan" else "moe_block.gate") in skip
    for code in ("modeling_grok1.py", "configuration_grok1.py"):
        assert (out / code).read_bytes() == (src / code).read_bytes()
    assert not list(out.glob("*.bin"))


def test_loads_with_trust_remote_code_and_matches_on_the_fly_quantization(grok, monkeypatch):
    import bitsandbytes as bnb
    from helpers import bnb_config
    from transformers import AutoModelForCausalLM

    naming, src, out, sentinel = grok
    monkeypatch.setenv("GROK_SENTINEL", str(sentinel))
    loaded = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, device_map="cpu")
    assert sentinel.exists()  # the sentinel works: loading with trust_remote_code does run the code
    modules = dict(loaded.named_modules())
    assert isinstance(modules[EXPERT[naming].removesuffix(".weight")], bnb.nn.Linear4bit)
    assert type(modules[ROUTER[naming].removesuffix(".weight")]) is torch.nn.Linear
    skip = json.loads((out / "config.json").read_text())["quantization_config"]["llm_int8_skip_modules"]
    fly = AutoModelForCausalLM.from_pretrained(
        src, trust_remote_code=True, device_map="cpu", quantization_config=bnb_config(llm_int8_skip_modules=skip)
    )
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = loaded(ids).logits.flatten(), fly(ids).logits.flatten()
    assert torch.nn.functional.cosine_similarity(a, b, dim=0) >= 0.999


def test_trust_remote_code_gives_the_same_decisions(grok, tmp_path):
    naming, src, out, _ = grok
    trusted = prequant.convert(src, tmp_path / "o", dry_run=True, trust_remote_code=True)
    ruled = prequant.convert(src, tmp_path / "o", dry_run=True)
    assert "transformers meta model" in trusted.method and "name rules" in ruled.method
    assert {s.source.name: s.quantize for s in trusted.steps} == {s.source.name: s.quantize for s in ruled.steps}
    assert trusted.skip_modules == ruled.skip_modules


def test_malicious_pickle_is_refused_without_running_it(tmp_path):
    src = build_grok(tmp_path / "src", "keyfan", shards=1)
    shard = src / "pytorch_model-00001-of-00001.bin"
    state = torch.load(shard, weights_only=True)
    marker = tmp_path / "pwned"
    torch.save({**state, "evil": Evil(marker)}, shard)
    proc = run_cli("convert", str(src), str(tmp_path / "out"), "--device", "cpu")
    assert proc.returncode == 1
    assert "refused to unpickle" in proc.stderr and shard.name in proc.stderr
    assert "GLOBAL posix.system" in proc.stderr  # what was refused, and not torch's advice to load it anyway:
    assert "weights_only" not in proc.stderr and "add_safe_globals" not in proc.stderr
    assert not marker.exists()
    assert not (tmp_path / "out" / "config.json").exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bin_shards_convert_on_the_gpu_to_the_cpu_kernels_bytes(grok, tmp_path):
    """.bin tensors reach the GPU through torch's own mapping (no byte ranges): same bytes as the CPU run."""
    naming, src, out, _ = grok
    prequant.convert(src, tmp_path / "cuda", device="cuda", progress=False)
    cpu, cuda = read_checkpoint(out), read_checkpoint(tmp_path / "cuda")
    assert cpu.keys() == cuda.keys()
    for key, t in cpu.items():
        assert t.dtype == cuda[key].dtype and torch.equal(t.reshape(-1).view(torch.uint8), cuda[key].reshape(-1).view(torch.uint8)), key
