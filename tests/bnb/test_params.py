"""For configs drawn at random per architecture, each built and saved by the installed transformers (some with keys
then taken out of config.json): what transformers saves is settled, and whatever is settled transformers
accepts, with the predicted layout as its own and exactly the parameters `params.expected` says."""

import json
import warnings

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prequant.bnb import layout, params, predict
from prequant.checkpoint import hf_files
from prequant.errors import PrequantError
from prequant.source import resolve as sources

from test_predict import VERIFIED_HIGH

torch = pytest.importorskip("torch")
tf = pytest.importorskip("transformers")



@st.composite
def decoder_configs(draw, cls, *, head_dim_optional, biases=("attention_bias",), experts=None):
    heads = draw(st.sampled_from([1, 2, 4]))
    kv = draw(st.sampled_from([k for k in (1, 2, 4) if heads % k == 0]))
    head_dim = draw(st.sampled_from([4, 8]))
    given_dim = not head_dim_optional or draw(st.booleans())
    hidden = draw(st.sampled_from([8, 24])) if given_dim else heads * head_dim
    kwargs = dict(hidden_size=hidden, intermediate_size=draw(st.sampled_from([8, 20])),
                  num_hidden_layers=draw(st.integers(1, 2)), num_attention_heads=heads, num_key_value_heads=kv,
                  vocab_size=draw(st.sampled_from([16, 40])), tie_word_embeddings=draw(st.booleans()))
    if given_dim:
        kwargs["head_dim"] = head_dim
    kwargs |= {flag: draw(st.booleans()) for flag in biases}
    if experts == "mixtral":
        kwargs |= dict(num_local_experts=draw(st.integers(1, 3)), num_experts_per_tok=1)
    routed = ["num_experts", "num_local_experts", "moe_intermediate_size", "decoder_sparse_step", "mlp_only_layers"]
    if experts == "qwen3_moe":  # sparse layers by step, dense ones listed
        kwargs |= dict(num_experts=draw(st.integers(1, 3)), num_experts_per_tok=1,
                       moe_intermediate_size=draw(st.sampled_from([8, 12])),
                       decoder_sparse_step=draw(st.integers(1, 2)),
                       mlp_only_layers=draw(st.sampled_from([[], [0], [1]])))
    droppable = [*biases, "num_key_value_heads", "head_dim", "tie_word_embeddings",
                 *(routed if experts == "qwen3_moe" else ())]
    dropped = draw(st.one_of(st.just(set()), st.sets(st.sampled_from(droppable), min_size=1)))
    return cls(**kwargs), dropped


def _gpt2_configs():
    return st.builds(
        lambda heads, per_head, layers, inner, positions, tied, dropped: (tf.GPT2Config(
            n_embd=heads * per_head, n_head=heads, n_layer=layers, n_inner=inner, n_positions=positions,
            vocab_size=40, bos_token_id=0, eos_token_id=0, tie_word_embeddings=tied), dropped),
        st.sampled_from([1, 2, 4]), st.sampled_from([4, 8]), st.integers(1, 2), st.sampled_from([None, 12]),
        st.sampled_from([8, 16]), st.booleans(),
        st.one_of(st.just(set()), st.sets(st.sampled_from(["n_inner", "tie_word_embeddings"]), min_size=1)))


ARCHITECTURES = {
    "llama": decoder_configs(tf.LlamaConfig, head_dim_optional=True, biases=("attention_bias", "mlp_bias")),
    "mistral": decoder_configs(tf.MistralConfig, head_dim_optional=True, biases=()),
    "qwen2": decoder_configs(tf.Qwen2Config, head_dim_optional=True, biases=()),
    "qwen3": decoder_configs(tf.Qwen3Config, head_dim_optional=False),
    "gemma": decoder_configs(tf.GemmaConfig, head_dim_optional=False),
    "mixtral": decoder_configs(tf.MixtralConfig, head_dim_optional=True, biases=(), experts="mixtral"),
    "qwen3_moe": decoder_configs(tf.Qwen3MoeConfig, head_dim_optional=True, experts="qwen3_moe"),
    "gpt2": _gpt2_configs(),
}


def _save(config, dropped, path):
    """transformers' own checkpoint of a model built from `config`, with the keys in `dropped` then taken out of
    its config.json (transformers then reads its class default, which may no longer fit the weights)."""
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.save_pretrained(path)
    saved = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({k: v for k, v in saved.items() if k not in dropped}))
    return path


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_expected_parameters_are_what_transformers_saves_and_the_layout_is_its_own(arch, tmp_path_factory):
    outcomes = []

    # Derandomized: the same 20 draws on every run, so how many settle (at least 5, asserted below) is fixed.
    @settings(max_examples=20, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(ARCHITECTURES[arch])
    def check(drawn):
        config, dropped = drawn
        src = sources.resolve(str(_save(config, dropped, tmp_path_factory.mktemp(arch))))
        tensors = sources.scan(src)
        cfg = hf_files.read_config(src.path)
        try:
            decided = layout.analyze(cfg, src.path, tensors, [])
        except PrequantError:  # transformers refuses these weights with this config.json
            decided = None
        is_settled = predict.settled(cfg, tensors, transformers_version=VERIFIED_HIGH)
        outcomes.append(is_settled)
        if not dropped:
            assert is_settled, "a checkpoint as transformers saves it is settled"
        if not is_settled:
            return  # the conversion asks transformers: nothing is assumed
        assert decided is not None, "settled, yet transformers refuses the checkpoint"
        assert predict.predict(cfg, tensors, []) == decided
        shapes = params.expected(cfg["architectures"][0], cfg)
        saved = {t.name: tuple(t.shape) for t in tensors}
        assert saved == shapes or saved == {k: v for k, v in shapes.items() if k != "lm_head.weight"}

    check()
    assert sum(outcomes) >= 5, f"only {sum(outcomes)} of {len(outcomes)} drawn checkpoints settled: too few checked"


def test_what_expected_cannot_tell_is_none():
    base = dict(hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2, vocab_size=16)
    assert params.expected("LlamaForCausalLM", base) is not None
    assert params.expected("Qwen3ForCausalLM", base) is None, "Qwen3's head_dim default is its class's"
    assert params.expected("LlamaForCausalLM", base | {"hidden_size": 9}) is None
    assert params.expected("LlamaForCausalLM", base | {"num_key_value_heads": 3, "head_dim": 4}) is None
    assert params.expected("LlamaForCausalLM", base | {"mlp_bias": None}) is None
    assert params.expected("LlamaForCausalLM", base | {"num_hidden_layers": True}) is None
    assert params.expected("MixtralForCausalLM", base) is None, "no num_local_experts"
    routed = base | dict(num_key_value_heads=2, num_experts=2, moe_intermediate_size=4, decoder_sparse_step=1,
                         mlp_only_layers=[])
    assert params.expected("Qwen3MoeForCausalLM", routed) is not None
    for key in ("num_experts", "moe_intermediate_size", "decoder_sparse_step", "mlp_only_layers"):
        without = {k: v for k, v in routed.items() if k != key}
        assert params.expected("Qwen3MoeForCausalLM", without) is None, key
    assert params.expected("Qwen3MoeForCausalLM", routed | {"num_local_experts": 3}) is None, "two expert counts"
    assert params.expected("GPT2LMHeadModel", dict(n_embd=8, n_layer=1, n_head=2, vocab_size=16, n_positions=8,
                                                   add_cross_attention=True)) is None
    assert params.expected("FalconForCausalLM", base) is None
