"""The plan's predictions: shard sizes before anything is written."""

from __future__ import annotations

import json

import torch
from helpers import run_main
from safetensors.torch import save_file

import prequant
from prequant.checkpoint.safetensors import read_header
from prequant.conversion import plan as plan_module


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


def test_a_plan_lays_its_shards_out_once(checkpoints, tmp_path, monkeypatch):
    """A layout is a pass over every output tensor (tens of thousands in a large MoE model): the fingerprint, the
    text and the summary share one."""
    plan = prequant.convert(checkpoints("llama"), tmp_path / "unused", dry_run=True)
    built = []

    class Counted(plan_module.ShardLayout):
        def __init__(self, *args, **kwargs) -> None:
            built.append(1)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(plan_module, "ShardLayout", Counted)
    sizes = plan.shard_bytes()
    sizes.clear()  # the caller's copy
    assert plan.to_dict()["shards"] == plan.shard_bytes() and plan.output_bytes == sum(plan.shard_bytes().values())
    plan.to_text()
    assert len(built) == len(plan.shards)


# --- shards: one when everything fits, else tapering towards the end (their hashes end with the writes) ---------

GB = 10**9


def _shard_sizes(sizes: list[int], max_shard_size: int) -> list[int]:
    shard_of = plan_module._assign_shards(sizes, max_shard_size)
    assert shard_of == sorted(shard_of) and sorted(set(shard_of)) == list(range(max(shard_of) + 1)), shard_of
    totals = [0] * (max(shard_of) + 1)
    for shard, size in zip(shard_of, sizes):
        totals[shard] += size
    return totals


def _groups(sizes: list[int], max_shard_size: int) -> list[list[int]]:
    shard_of = plan_module._assign_shards(sizes, max_shard_size)
    return [[s for s, k in zip(sizes, shard_of) if k == shard] for shard in range(max(shard_of) + 1)]


def test_an_output_that_fits_is_one_shard():
    assert _shard_sizes([GB] * 5, 5 * GB) == [5 * GB]


def test_a_llama_8b_shaped_output_ends_in_shards_hashed_while_the_next_is_written():
    """70 quantized groups of 80 MB, then the 1.05 GB lm_head kept: the head alone is the last shard (larger than
    TAIL_SHARD, it cannot share), the one before holds at most as much (its hash is done while the head is
    copied), and none exceeds the limit."""
    sizes = [80 * 10**6] * 70 + [1_050_000_000]
    totals = _shard_sizes(sizes, 5 * GB)
    assert totals[-1] == 1_050_000_000
    assert totals[-2] <= totals[-1]
    assert all(t <= 5 * GB for t in totals) and sum(totals) == sum(sizes)


def test_shards_shrink_towards_the_end_down_to_the_tail_size():
    """Uniform groups: the last shard holds at most TAIL_SHARD, each one before at most all the later ones together
    (at least TAIL_SHARD), and every shard is full to its limit except the first (the remainder)."""
    group = 100 * 10**6
    totals = _shard_sizes([group] * 300, 5 * GB)
    tail = plan_module.TAIL_SHARD
    assert totals[-1] <= tail and totals[-1] + group > tail
    for i in range(1, len(totals) - 1):
        limit = min(5 * GB, max(tail, sum(totals[i + 1 :])))
        assert totals[i] <= limit and totals[i] + group > limit, totals
    assert totals[-6:] == [5 * GB, 4 * GB, 2 * GB, GB, 500 * 10**6, 500 * 10**6], totals
    assert 0 < totals[0] <= 5 * GB


def test_a_group_larger_than_the_limit_gets_a_shard_of_its_own():
    assert _groups([6 * GB, 10, 6 * GB], 5 * GB) == [[6 * GB], [10], [6 * GB]]
    assert _groups([10, 20, 6 * GB], 5 * GB) == [[10, 20], [6 * GB]]


def test_a_conversion_with_tapered_shards_loads_and_verifies(checkpoints, tmp_path, monkeypatch):
    """The writer, the index and verify take any assignment: a tiny Llama with the tail scaled down to its size."""
    from transformers import AutoModelForCausalLM

    from prequant.verify.run import verify

    monkeypatch.setattr(plan_module, "TAIL_SHARD", 10_000)
    src, out = checkpoints("llama"), tmp_path / "out"
    prequant.convert(src, out, device="cpu", progress=False, max_shard_size="60KB")
    files = sorted(out.glob("model-*.safetensors"))
    shards = [read_header(f)[0] for f in files]
    data = [sum(t.nbytes for t in tensors) for tensors in shards]
    assert len(files) >= 3 and all(d <= 60_000 for d in data), data
    assert data[-1] <= 10_000 or len(shards[-1]) == 1, data  # the tail, as written
    for i, (shard, tensors) in enumerate(zip(data[:-1], shards)):  # front-to-back shards would break this
        assert shard <= max(sum(data[i + 1 :]), 10_000) or len(tensors) == 1, data
    weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert sorted(set(weight_map.values())) == [f.name for f in files]
    assert verify(out, src, progress=False).ok
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.quantization_config.quant_method == "bitsandbytes"


def test_a_skip_pattern_that_matches_nothing_is_a_warning_in_the_plan_and_on_stderr(checkpoints, tmp_path):
    """A typo in --skip keeps nothing unquantized; the plan says so, rather than planning as if it were not given."""
    src = checkpoints("llama")
    plan = prequant.convert(src, tmp_path / "unused", dry_run=True, skip=["lm_haed", "model.layers.0.mlp", "q_proj"])
    warned = [w for w in plan.warnings if "matches no module" in w]
    assert len(warned) == 1 and "'lm_haed'" in warned[0]  # matched ones (a module path, a name's end) are not
    assert f"warning: {warned[0]}" in plan.to_text() and warned[0] in plan.to_dict()["warnings"]
    assert not prequant.convert(src, tmp_path / "unused", dry_run=True, skip=["lm_head"]).warnings
    code, stdout, stderr = run_main("convert", str(src), str(tmp_path / "out"), "--device", "cpu", "--no-stats",
                                    "--skip", "lm_haed")
    assert code == 0 and "warning: the skip pattern 'lm_haed' matches no module of the checkpoint" in stderr
    assert "wrote " in stdout


def test_the_plan_text_nests_no_parentheses_and_counts_in_words(checkpoints, tmp_path):
    text = prequant.convert(checkpoints("llama"), tmp_path / "unused", dry_run=True, skip=["model.layers.0"]).to_text()
    assert "(skipped: output embedding / tied / last module)" in text and "(skipped: --skip)" in text
    assert "((" not in text and "))" not in text and "(s)" not in text
    assert text.splitlines()[-1].endswith(" in 1 shard")
