"""convert() against transformers' own quantize-on-load + save_pretrained, for each decoder layout."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import MIXES, bnb_config, read_checkpoint, retyped, transformers_reference

import prequant
from prequant.conversion.plan import parse_size

KINDS = ["llama", "llama_tied", "gpt2", "qwen2", "mixtral"]


@pytest.fixture(scope="module")
def converted(checkpoints, tmp_path_factory):
    """(source, prequant output, transformers output) per kind, built once."""
    made: dict[str, tuple[Path, Path, Path]] = {}

    def get(kind: str) -> tuple[Path, Path, Path]:
        if kind not in made:
            src = checkpoints(kind)
            out = tmp_path_factory.mktemp(f"{kind}-prequant") / "out"
            prequant.convert(src, out, device="cpu", progress=False)
            ref = transformers_reference(src, tmp_path_factory.mktemp(f"{kind}-ref"))
            made[kind] = (src, out, ref)
        return made[kind]

    return get


def _state(t: torch.Tensor) -> dict:
    return json.loads(bytes(t.tolist()))


@pytest.mark.parametrize("kind", KINDS)
def test_keys_dtypes_shapes_match_transformers(converted, kind):
    _, out, ref = converted(kind)
    ours, theirs = read_checkpoint(out), read_checkpoint(ref)
    assert sorted(ours) == sorted(theirs)
    for key, t in theirs.items():
        if ".quant_state." in key:
            # Its length follows the digits of nested_offset, whose last bits differ between the
            # reference made here (bitsandbytes' CPU path) and our CUDA-exact kernel; the JSON test
            # below compares its content.
            assert ours[key].dtype == t.dtype == torch.uint8 and ours[key].dim() == t.dim() == 1, key
            continue
        assert (ours[key].dtype, ours[key].shape) == (t.dtype, t.shape), key


@pytest.mark.parametrize("kind", KINDS)
def test_quant_state_json_matches_transformers(converted, kind):
    _, out, ref = converted(kind)
    ours, theirs = read_checkpoint(out), read_checkpoint(ref)
    states = [k for k in theirs if ".quant_state." in k]
    assert states, "the reference quantized nothing"
    for key in states:
        a, b = _state(ours[key]), _state(theirs[key])
        # The offset is the mean of absmax: bitsandbytes' CPU path (the reference here) and our
        # CUDA-exact kernel may differ in its last bits; everything else must be identical.
        assert a.pop("nested_offset", 0.0) == pytest.approx(b.pop("nested_offset", 0.0), rel=1e-5), key
        assert a == b, key


@pytest.mark.parametrize("kind", KINDS)
def test_config_matches_transformers(converted, kind):
    src, out, ref = converted(kind)
    ours, theirs = (json.loads((d / "config.json").read_text()) for d in (out, ref))
    assert ours["quantization_config"] == theirs["quantization_config"]
    source = json.loads((src / "config.json").read_text())
    assert {k: v for k, v in ours.items() if k != "quantization_config"} == source


@pytest.mark.parametrize("kind", KINDS)
def test_unquantized_tensors_are_copied_byte_for_byte(converted, kind):
    src, out, _ = converted(kind)
    source, ours = read_checkpoint(src), read_checkpoint(out)
    kept = [k for k in source if k in ours and f"{k}.absmax" not in ours]
    assert kept
    for key in kept:
        assert ours[key].dtype == source[key].dtype and torch.equal(ours[key], source[key]), key


@pytest.mark.parametrize("kind", KINDS)
def test_loads_without_quantization_arguments_and_logits_agree(converted, kind):
    from transformers import AutoModelForCausalLM
    import bitsandbytes as bnb

    src, out, _ = converted(kind)
    loaded = AutoModelForCausalLM.from_pretrained(out, device_map="cpu")
    assert any(isinstance(m, bnb.nn.Linear4bit) for m in loaded.modules())
    on_the_fly = AutoModelForCausalLM.from_pretrained(src, quantization_config=bnb_config(), device_map="cpu")
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = loaded(ids).logits.float().flatten(), on_the_fly(ids).logits.float().flatten()
    assert torch.nn.functional.cosine_similarity(a, b, dim=0) >= 0.999


def test_side_files_are_copied(converted):
    src, out, _ = converted("llama")
    for name in ("tokenizer_config.json", "LICENSE", "generation_config.json"):
        assert (out / name).read_bytes() == (src / name).read_bytes()
    assert not (out / ".prequant-staging").exists()


def test_moe_experts_stay_unquantized_as_in_transformers(converted):
    _, out, _ = converted("mixtral")
    ours = read_checkpoint(out)
    experts = [k for k in ours if ".experts." in k]
    assert experts and not any(k.endswith(".absmax") for k in experts)
    assert "model.layers.0.self_attn.q_proj.weight.absmax" in ours


def test_sharded_source_gives_the_same_bytes_as_single_file(checkpoints, tmp_path):
    sharded = checkpoints("llama", max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").exists()
    a, b = tmp_path / "a", tmp_path / "b"
    prequant.convert(sharded, a, device="cpu", progress=False)
    prequant.convert(checkpoints("llama"), b, device="cpu", progress=False)
    ta, tb = read_checkpoint(a), read_checkpoint(b)
    assert sorted(ta) == sorted(tb)
    assert all(torch.equal(ta[k].view(torch.uint8), tb[k].view(torch.uint8)) for k in ta)


def test_max_shard_size_smaller_than_one_tensor(checkpoints, tmp_path):
    from transformers import AutoModelForCausalLM

    src = checkpoints("llama")
    summary = prequant.convert(src, tmp_path / "out", device="cpu", max_shard_size="1KB", progress=False)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    weight_map = index["weight_map"]
    assert summary.shards == len(set(weight_map.values())) > 10
    # A weight and its companions always share a shard.
    for key, shard in weight_map.items():
        if key.endswith(".absmax"):
            base = key.removesuffix(".absmax")
            assert {weight_map[k] for k in weight_map if k.startswith(base)} == {shard}
    files = {p.name for p in (tmp_path / "out").glob("*.safetensors")}
    assert files == set(weight_map.values())
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in read_checkpoint(tmp_path / "out").values())
    AutoModelForCausalLM.from_pretrained(tmp_path / "out", device_map="cpu")


@pytest.mark.parametrize(
    "options,overrides",
    [
        ({"quant_type": "fp4"}, {"bnb_4bit_quant_type": "fp4"}),
        ({"double_quant": False}, {"bnb_4bit_use_double_quant": False}),
        ({"quant_storage": "uint8"}, {"bnb_4bit_quant_storage": torch.uint8}),
    ],
    ids=["fp4", "no-double-quant", "uint8-storage"],
)
def test_settings_variants_match_transformers_layout(checkpoints, tmp_path, options, overrides):
    src = checkpoints("llama")
    prequant.convert(src, tmp_path / "out", device="cpu", progress=False, **options)
    ours = read_checkpoint(tmp_path / "out")
    theirs = read_checkpoint(transformers_reference(src, tmp_path / "ref", **overrides))
    assert {k: (v.dtype, v.shape) for k, v in ours.items()} == {k: (v.dtype, v.shape) for k, v in theirs.items()}
    ours_cfg = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    theirs_cfg = json.loads((tmp_path / "ref" / "config.json").read_text())["quantization_config"]
    assert ours_cfg == theirs_cfg
    if "quant_storage" in options:
        packed = [k for k in ours if k + ".absmax" in ours]
        assert packed and all(ours[k].dtype == torch.uint8 for k in packed)


def test_blocksize_128_packs_one_absmax_per_128_weights(checkpoints, tmp_path):
    # transformers has no blocksize option, so there is no reference to compare with: check that the packed
    # state says what we asked for, and that every quantized tensor has one absmax per block of 128 values.
    import math

    src = checkpoints("llama")
    prequant.convert(src, tmp_path / "out", device="cpu", progress=False, quant_storage="uint8", blocksize=128)
    ours, source = read_checkpoint(tmp_path / "out"), read_checkpoint(src)
    state = _state(ours["model.layers.0.mlp.up_proj.weight.quant_state.bitsandbytes__nf4"])
    assert state["blocksize"] == 128
    quantized = [k.removesuffix(".absmax") for k in ours if k.endswith(".absmax")]
    assert quantized
    for key in quantized:
        numel = source[key].numel()
        assert ours[f"{key}.absmax"].numel() == math.ceil(numel / 128), key
        assert _state(ours[f"{key}.quant_state.bitsandbytes__nf4"])["blocksize"] == 128, key
        assert ours[key].dtype == torch.uint8 and ours[key].numel() == math.ceil(numel / 2), key


def test_skip_keeps_module_and_config_lists_it_with_the_defaults(checkpoints, tmp_path):
    from transformers import AutoModelForCausalLM
    import bitsandbytes as bnb

    src = checkpoints("llama")
    prequant.convert(src, tmp_path / "out", device="cpu", skip=["mlp.down_proj"], progress=False)
    ours = read_checkpoint(tmp_path / "out")
    assert "model.layers.0.mlp.down_proj.weight.absmax" not in ours
    assert "model.layers.0.mlp.up_proj.weight.absmax" in ours
    skip = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]["llm_int8_skip_modules"]
    assert set(skip) == {"lm_head", "mlp.down_proj"}
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out", device_map="cpu")
    assert type(model.model.layers[0].mlp.down_proj) is torch.nn.Linear
    assert not isinstance(model.lm_head, bnb.nn.Linear4bit)
    assert isinstance(model.model.layers[0].mlp.up_proj, bnb.nn.Linear4bit)


def test_nan_weight_is_refused_naming_the_tensor(tmp_path, checkpoints):
    from safetensors.torch import load_file, save_file

    src = tmp_path / "src"
    src.mkdir()
    base = checkpoints("llama")
    for f in base.iterdir():
        (src / f.name).write_bytes(f.read_bytes())
    tensors = load_file(src / "model.safetensors")
    tensors["model.layers.1.self_attn.q_proj.weight"][3, 5] = float("nan")
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(prequant.PrequantError, match=r"model\.layers\.1\.self_attn\.q_proj\.weight.*NaN"):
        prequant.convert(src, tmp_path / "out", device="cpu", progress=False)
    assert not (tmp_path / "out" / "config.json").exists()


def test_dry_run_writes_nothing_and_lists_every_tensor(checkpoints, tmp_path):
    plan = prequant.convert(checkpoints("gpt2"), tmp_path / "out", dry_run=True)
    assert not (tmp_path / "out").exists()
    actions = {t["name"]: t["action"] for t in plan.to_dict()["tensors"]}
    assert actions["transformer.h.0.attn.c_attn.weight"] == "quantize"
    assert actions["transformer.wte.weight"] == "keep"
    assert plan.to_dict()["output_bytes"] < plan.to_dict()["input_bytes"]


def test_parse_size_reads_units_like_transformers():
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("500MiB") == 500 * 2**20
    assert parse_size("1kb") == 1000
    assert parse_size(123) == 123
    with pytest.raises(prequant.UsageError):
        parse_size("lots")


def test_conversions_leave_no_file_descriptors_open(checkpoints, tmp_path):
    """Shards, source files, the files handed to the hashing threads: every descriptor a conversion opens is closed."""
    import os

    src = checkpoints("llama", "200KB")  # several shards
    prequant.convert(src, tmp_path / "warm-up", device="cpu", progress=False)
    before = set(os.listdir("/proc/self/fd"))
    for i in range(3):
        prequant.convert(src, tmp_path / f"out{i}", device="cpu", progress=False)
    assert set(os.listdir("/proc/self/fd")) == before


def test_conversions_leave_no_hashing_threads_behind(checkpoints, tmp_path):
    import threading

    for i in range(2):
        prequant.convert(checkpoints("llama", "200KB"), tmp_path / f"out{i}", device="cpu", progress=False)
    assert not [t.name for t in threading.enumerate() if t.name.startswith("prequant-hash")]


# --- tensors stored in another dtype than the model's ----------------------------------------------------------

@pytest.fixture(scope="module")
def mixed(checkpoints, tmp_path_factory):
    """(source, prequant output, transformers output) per mix, built once."""
    made: dict[str, tuple[Path, Path, Path]] = {}

    def get(mix: str) -> tuple[Path, Path, Path]:
        if mix not in made:
            src = retyped(checkpoints("llama"), tmp_path_factory.mktemp(f"{mix}-src") / "src", MIXES[mix])
            out = tmp_path_factory.mktemp(f"{mix}-prequant") / "out"
            prequant.convert(src, out, device="cpu", progress=False)
            made[mix] = (src, out, transformers_reference(src, tmp_path_factory.mktemp(f"{mix}-ref")))
        return made[mix]

    return get


@pytest.mark.parametrize("mix", list(MIXES))
def test_tensors_in_other_dtypes_are_kept_as_transformers_keeps_them(mixed, mix):
    """Kept tensors in transformers' dtype (the model's) with its bytes (torch's rounding)."""
    _, out, ref = mixed(mix)
    ours, theirs = read_checkpoint(out), read_checkpoint(ref)
    assert sorted(ours) == sorted(theirs)
    kept = [k for k in theirs if f"{k}.absmax" not in theirs and ".quant_state." not in k and not k.endswith(
        (".absmax", ".quant_map", ".nested_absmax", ".nested_quant_map"))]
    assert {k for k in MIXES[mix] if f"{k}.absmax" not in theirs} <= set(kept)
    for key in kept:
        assert ours[key].dtype == theirs[key].dtype == torch.bfloat16, key
        assert torch.equal(ours[key].view(torch.uint8), theirs[key].view(torch.uint8)), key
    for key, t in theirs.items():
        assert (ours[key].dtype, ours[key].dim()) == (t.dtype, t.dim()), key


@pytest.mark.parametrize("mix", list(MIXES))
def test_tensors_in_other_dtypes_are_quantized_from_the_models_dtype(mixed, mix):
    """The quant state says bfloat16, as transformers', which casts before quantizing."""
    _, out, ref = mixed(mix)
    ours, theirs = read_checkpoint(out), read_checkpoint(ref)
    for name in (n for n in MIXES[mix] if f"{n}.absmax" in theirs):
        key = f"{name}.quant_state.bitsandbytes__nf4"
        a, b = _state(ours[key]), _state(theirs[key])
        assert a.pop("nested_offset") == pytest.approx(b.pop("nested_offset"), rel=1e-5), key
        assert a == b and a["dtype"] == "bfloat16", key


@pytest.mark.parametrize("mix", list(MIXES))
def test_tensors_in_other_dtypes_give_the_bytes_of_the_source_cast_first(mixed, tmp_path, mix):
    """Every byte equals the conversion of the same checkpoint cast to bf16 by torch, as transformers loads it
    (bitsandbytes' CPU path, the reference here, packs other bytes than CUDA's; the GPU test compares those)."""
    from safetensors.torch import load_file, save_file

    src, out, _ = mixed(mix)
    cast = tmp_path / "cast"
    cast.mkdir()
    for f in src.iterdir():
        (cast / f.name).write_bytes(f.read_bytes())
    save_file({k: v.to(torch.bfloat16) for k, v in load_file(src / "model.safetensors").items()},
              cast / "model.safetensors", metadata={"format": "pt"})
    prequant.convert(cast, tmp_path / "out", device="cpu", progress=False)
    ours, expected = read_checkpoint(out), read_checkpoint(tmp_path / "out")
    assert sorted(ours) == sorted(expected)
    for key in ours:
        assert ours[key].dtype == expected[key].dtype and torch.equal(ours[key].view(torch.uint8),
                                                                    expected[key].view(torch.uint8)), key


@pytest.mark.parametrize("mix", list(MIXES))
def test_tensors_in_other_dtypes_verify_against_their_source(mixed, mix):
    from prequant.verify.run import verify

    src, out, _ = mixed(mix)
    report = verify(out, src, progress=False)
    assert report.ok, report.to_text()
    assert report.source["kept"] == 7 and report.source["quantized"] == 14


def test_odd_element_count_converts_with_uint8_storage(tmp_path):
    """37 x 98 weights: refused with bf16 storage (a byte short, see test_bad_inputs), fine with uint8, the fix
    the refusal names; the layout is transformers'."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(hidden_size=98, intermediate_size=37, num_hidden_layers=1, num_attention_heads=1,
                         num_key_value_heads=1, vocab_size=64)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(tmp_path / "src")
    with pytest.raises(prequant.PrequantError, match=r"use quant_storage='uint8' \(or skip=\['model"):
        prequant.convert(tmp_path / "src", tmp_path / "bf16", device="cpu", progress=False)  # in Python's words
    assert not (tmp_path / "bf16").exists()  # refused before any work
    prequant.convert(tmp_path / "src", tmp_path / "out", device="cpu", progress=False, quant_storage="uint8")
    ours = read_checkpoint(tmp_path / "out")
    theirs = read_checkpoint(transformers_reference(tmp_path / "src", tmp_path / "ref",
                                                    bnb_4bit_quant_storage=torch.uint8))
    assert {k: (v.dtype, v.shape) for k, v in ours.items() if ".quant_state." not in k} == {
        k: (v.dtype, v.shape) for k, v in theirs.items() if ".quant_state." not in k}
    assert ours["model.layers.0.mlp.down_proj.weight"].numel() == 1813
    AutoModelForCausalLM.from_pretrained(tmp_path / "out", device_map="cpu")
