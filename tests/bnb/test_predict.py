"""The layout predicted from names is exactly the layout transformers decides, for every architecture built here."""

from dataclasses import replace

import pytest

from prequant.bnb import layout, predict
from prequant.checkpoint import hf_files
from prequant.source import resolve as sources

from helpers import build_grok

SKIPS = [[], ["mlp.down_proj"], ["lm_head"], ["model.layers.0"], ["h.0.mlp"]]
KINDS = ["llama", "llama_tied", "gpt2", "qwen2", "qwen3", "gemma", "mistral", "mixtral", "qwen3_moe"]
VERIFIED_LOW, VERIFIED_HIGH = ("{}.{}.0".format(*v) for v in predict.VERIFIED)


def _both(src_dir, skip, trust=False):
    src = sources.resolve(str(src_dir))
    tensors = sources.scan(src)
    config = hf_files.read_config(src.path)
    return layout.analyze(config, src.path, tensors, skip, trust), predict.predict(config, tensors, skip, trust)


@pytest.mark.parametrize("skip", SKIPS, ids=lambda s: ",".join(s) or "no-skip")
@pytest.mark.parametrize("kind", KINDS)
def test_prediction_is_transformers_layout(checkpoints, kind, skip):
    decided, predicted = _both(checkpoints(kind), skip)
    assert predicted is not None, f"no prediction for {kind}"
    assert predicted == decided


def _scan(src_dir):
    src = sources.resolve(str(src_dir))
    return hf_files.read_config(src.path), sources.scan(src)


@pytest.mark.parametrize("kind", KINDS)
def test_every_checkpoint_transformers_writes_is_settled_on_a_verified_version(checkpoints, kind):
    """What transformers saves for each known architecture is exactly what `params.expected` says it holds."""
    config, tensors = _scan(checkpoints(kind))
    assert predict.settled(config, tensors, transformers_version=VERIFIED_HIGH)
    assert predict.settled(config, tensors, transformers_version=VERIFIED_LOW)


@pytest.mark.parametrize("version", ["4.57.1", "5.0.0", "5.99.0", "6.0.0"])
def test_a_transformers_outside_the_verified_versions_settles_nothing(checkpoints, version):
    config, tensors = _scan(checkpoints("llama"))
    assert not predict.settled(config, tensors, transformers_version=version)


GATE = "model.layers.0.mlp.gate_proj.weight"


def _renamed(tensors, old, new):
    return [replace(t, name=new) if t.name == old else t for t in tensors]


# Each edit of a checkpoint's tensors (names and shapes: all `settled` reads of them) or of its config.json.
TENSOR_EDITS = {
    "extra tensor": lambda ts: [*ts, replace(next(t for t in ts if t.name == GATE), name="model.layers.0.mlp.x.weight")],
    "missing tensor": lambda ts: [t for t in ts if t.name != GATE],
    "renamed tensor": lambda ts: _renamed(ts, GATE, "model.layers.0.mlp.gate.weight"),
    "transposed weight": lambda ts: [replace(t, shape=t.shape[::-1]) if t.name == GATE else t for t in ts],
    "a name twice": lambda ts: [*ts, next(t for t in ts if t.name == GATE)],
    "untied head missing": lambda ts: [t for t in ts if t.name != "lm_head.weight"],
}
CONFIG_EDITS = {
    "fewer layers in config": lambda c: c.update(num_hidden_layers=1),
    "config without a dimension": lambda c: c.pop("intermediate_size"),
    "a dimension that is not a number": lambda c: c.update(hidden_size="64"),
    "unknown architecture": lambda c: c.update(architectures=["LlamaForSequenceClassification"]),
    "remote code": lambda c: c.update(auto_map={"AutoModelForCausalLM": "modeling.Model"}),
    "a bias flag that is not a bool": lambda c: c.update(attention_bias="yes"),
    "untied config of a tied checkpoint": lambda c: c.update(tie_word_embeddings=False),
    "another model_type": lambda c: c.update(model_type="mistral"),
    "no model_type": lambda c: c.pop("model_type"),
    "a quantized source": lambda c: c.update(quantization_config={"quant_method": "bitsandbytes"}),
}


@pytest.mark.parametrize("case", [*TENSOR_EDITS, *CONFIG_EDITS, "tied head held too"])
def test_what_the_rules_do_not_say_exactly_is_not_settled(checkpoints, case):
    """Each is left for transformers to decide (`predict.decide` asks it)."""
    tied = case in ("tied head held too", "untied config of a tied checkpoint")
    config, tensors = _scan(checkpoints("llama_tied" if tied else "llama"))
    assert predict.settled(config, tensors, transformers_version=VERIFIED_HIGH)  # before the edit
    config = dict(config)
    if case == "tied head held too":
        embed = next(t for t in tensors if t.name == "model.embed_tokens.weight")
        tensors = [*tensors, replace(embed, name="lm_head.weight")]
    elif case in TENSOR_EDITS:
        tensors = TENSOR_EDITS[case](tensors)
    else:
        CONFIG_EDITS[case](config)
    assert not predict.settled(config, tensors, transformers_version=VERIFIED_HIGH)


@pytest.fixture(scope="module", params=["keyfan", "hpcai"])
def grok(request, tmp_path_factory):
    return build_grok(tmp_path_factory.mktemp(f"grok-{request.param}") / "grok", request.param)


@pytest.mark.parametrize("skip", SKIPS[:3], ids=lambda s: ",".join(s) or "no-skip")
def test_prediction_is_transformers_layout_for_trusted_grok(grok, skip):
    decided, predicted = _both(grok, skip, trust=True)
    assert decided.method.startswith("transformers meta model (Grok1ModelForCausalLM)")
    assert predicted == decided


def test_trusted_remote_code_is_never_settled(grok):
    config, tensors = _scan(grok)
    assert not predict.settled(config, tensors, transformers_version=VERIFIED_HIGH)


def test_untrusted_remote_code_is_not_predicted(grok):
    """Without --trust-remote-code the name rules decide at once: there is nothing to predict."""
    decided, predicted = _both(grok, [], trust=False)
    assert predicted is None and decided.method.startswith("name rules")


def test_every_known_architecture_is_built_and_settled_here(checkpoints):
    """A class added to KNOWN without a checkpoint above (and its config class' model_type) would be unverified."""
    built = {_scan(checkpoints(kind))[0]["architectures"][0] for kind in KINDS}
    assert built == set(predict.KNOWN) == set(predict.MODEL_TYPES)
    for kind in KINDS:
        config, _ = _scan(checkpoints(kind))
        assert config["model_type"] == predict.MODEL_TYPES[config["architectures"][0]]


(_LOW, _HIGH) = predict.VERIFIED


@pytest.mark.parametrize("version,expected", [
    (f"{_LOW[0]}.{_LOW[1]}.0", True), (f"{_HIGH[0]}.{_HIGH[1]}.3", True), (f"{_LOW[0]}.{_LOW[1] - 1}.9", False),
    (f"{_HIGH[0]}.{_HIGH[1] + 1}.0", False), ("4.57.1", False), ("nightly", False)])
def test_only_the_verified_versions_are_verified(version, expected):
    assert predict.verified(version) is expected
