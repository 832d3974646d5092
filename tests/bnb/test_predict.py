"""The layout predicted from names is exactly the layout transformers decides, for every architecture built here."""

import pytest

from prequant.bnb import layout, predict
from prequant.checkpoint import hf_files
from prequant.source import resolve as sources

from conftest import build_grok

SKIPS = [[], ["mlp.down_proj"], ["lm_head"], ["model.layers.0"], ["h.0.mlp"]]


def _both(src_dir, skip, trust=False):
    src = sources.resolve(str(src_dir))
    tensors = sources.scan(src)
    config = hf_files.read_config(src.path)
    return layout.analyze(config, src.path, tensors, skip, trust), predict.predict(config, tensors, skip, trust)


@pytest.mark.parametrize("skip", SKIPS, ids=lambda s: ",".join(s) or "no-skip")
@pytest.mark.parametrize("kind", ["llama", "llama_tied", "gpt2", "qwen2", "mixtral"])
def test_prediction_is_transformers_layout(checkpoints, kind, skip):
    decided, predicted = _both(checkpoints(kind), skip)
    assert predicted is not None, f"no prediction for {kind}"
    assert predicted == decided


@pytest.fixture(scope="module", params=["keyfan", "hpcai"])
def grok(request, tmp_path_factory):
    return build_grok(tmp_path_factory.mktemp(f"grok-{request.param}") / "grok", request.param)


@pytest.mark.parametrize("skip", SKIPS[:3], ids=lambda s: ",".join(s) or "no-skip")
def test_prediction_is_transformers_layout_for_trusted_grok(grok, skip):
    decided, predicted = _both(grok, skip, trust=True)
    assert decided.method.startswith("transformers meta model (Grok1ModelForCausalLM)")
    assert predicted == decided


def test_untrusted_remote_code_is_not_predicted(grok):
    """Without --trust-remote-code the name rules decide at once: there is nothing to predict."""
    decided, predicted = _both(grok, [], trust=False)
    assert predicted is None and decided.method.startswith("name rules")


def test_prediction_can_be_turned_off(checkpoints, monkeypatch):
    monkeypatch.setenv(predict.ENV, "0")
    assert _both(checkpoints("llama"), [])[1] is None
