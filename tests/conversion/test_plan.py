"""The plan's predictions: shard sizes before anything is written."""

from __future__ import annotations

import json

import torch
from safetensors.torch import save_file

import prequant


def test_dry_run_predicts_shard_sizes_headers_included(tmp_path):
    """5,000 small tensors: their header entries weigh about as much as their data, and the prediction counts
    them (the writer's layout is fixed by the plan); only the quant-state JSON is an estimate."""
    src = tmp_path / "src"
    src.mkdir()
    tensors = {f"blocks.{i}.norm.weight": torch.ones(16, dtype=torch.bfloat16) for i in range(5000)}
    tensors["blocks.0.proj.weight"] = torch.randn(64, 64).bfloat16()
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    (src / "config.json").write_text(json.dumps({"architectures": ["Unknown"], "model_type": "unknown"}))
    plan = prequant.convert(src, tmp_path / "unused", dry_run=True)
    prequant.convert(src, tmp_path / "out", device="cpu", progress=False, stats=False)
    actual = (tmp_path / "out" / "model.safetensors").stat().st_size
    predicted = plan.shard_bytes()["model.safetensors"]
    assert abs(predicted - actual) <= 64, (predicted, actual)  # one quant state's JSON length is estimated
    assert plan.to_dict()["output_bytes"] == predicted
