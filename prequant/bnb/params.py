"""The parameters transformers' model of a known architecture holds, with their shapes, from config.json alone.

`predict` knows which modules of these architectures are linear layers; this module knows what else a model
built from a given config.json holds: every parameter, by checkpoint key, and the shape transformers requires
of it (it refuses a checkpoint tensor of another shape). With both, a checkpoint whose tensors are exactly
these parameters, in these shapes, is one whose layout transformers decides the way `predict` says, without
its modeling code being imported (`predict.settled`).

`expected` answers None wherever it cannot be sure: an architecture it does not model, a config key it needs
that config.json does not give (transformers' class default would then decide, which is not read here), a
value transformers would refuse, or an option that adds parameters it does not model (GPT-2's cross-attention).
None costs only time: the conversion then asks transformers, as it always did. The rules are those of
transformers 5 (`predict.VERIFIED` says which versions the tests compare them with, by building the models).
"""

from __future__ import annotations

Shapes = dict[str, tuple[int, ...]]
# Decoder families: the options that change which attention parameters exist. `qkv_bias` / `o_bias`: True or
# False when the architecture fixes it, else the config key that switches both (False when config.json omits
# it, as in every class here). `head_dim_default`: whether head_dim may be left out (hidden_size // heads) or
# must be given (Qwen3 and Gemma default to a fixed size that only their class knows); `kv_default`, the same
# for num_key_value_heads (Llama's is the number of heads; Mistral's, Mixtral's, Qwen's and Gemma's a fixed
# count of their class's, which tests/bnb/test_params.py found by leaving the key out).
_DECODERS: dict[str, dict] = {
    "LlamaForCausalLM": {"qkv_bias": "attention_bias", "o_bias": "attention_bias", "mlp_bias": True,
                         "head_dim_default": True, "kv_default": True},
    "MistralForCausalLM": {"qkv_bias": False, "o_bias": False, "head_dim_default": True},
    "Qwen2ForCausalLM": {"qkv_bias": True, "o_bias": False, "head_dim_default": True},
    "Qwen3ForCausalLM": {"qkv_bias": "attention_bias", "o_bias": "attention_bias", "qk_norm": True},
    "GemmaForCausalLM": {"qkv_bias": "attention_bias", "o_bias": "attention_bias"},
    "MixtralForCausalLM": {"qkv_bias": False, "o_bias": False, "head_dim_default": True, "experts": True},
    "Qwen3MoeForCausalLM": {"qkv_bias": "attention_bias", "o_bias": "attention_bias", "head_dim_default": True,
                            "qk_norm": True, "routed": True},
}


def expected(arch: str, config: dict) -> Shapes | None:
    """Every parameter of transformers' `arch` built from this config.json: checkpoint key -> shape (lm_head
    included even when tied: a checkpoint may hold it or not). None where this module cannot tell."""
    if arch in _DECODERS:
        return _decoder(_DECODERS[arch], config)
    return _gpt2(config) if arch == "GPT2LMHeadModel" else None


def _positive(*values: object) -> bool:
    return all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values)


def _ints(config: dict, *keys: str) -> list[int] | None:
    values = [config.get(k) for k in keys]
    return values if _positive(*values) else None  # type: ignore[return-value]


def _flag(config: dict, rule: bool | str) -> bool | None:
    """A fixed option, or the config key that sets it (absent: False, the class default); None if not a bool."""
    if isinstance(rule, bool):
        return rule
    value = config.get(rule, False)
    return value if isinstance(value, bool) else None


def _decoder(rules: dict, config: dict) -> Shapes | None:
    dims = _ints(config, "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "vocab_size")
    if dims is None:
        return None
    hidden, inter, layers, heads, vocab = dims
    kv = config.get("num_key_value_heads")
    kv = heads if kv is None and rules.get("kv_default") else kv
    head_dim = config.get("head_dim")
    if head_dim is None and rules.get("head_dim_default"):
        if hidden % heads:
            return None
        head_dim = hidden // heads
    qkv_bias, o_bias = _flag(config, rules["qkv_bias"]), _flag(config, rules["o_bias"])
    mlp_bias = _flag(config, "mlp_bias") if rules.get("mlp_bias") else False
    if not _positive(kv, head_dim) or None in (qkv_bias, o_bias, mlp_bias) or heads % kv:
        return None
    shapes: Shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,),
                      "lm_head.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        attn = {"q_proj": (heads * head_dim, hidden), "k_proj": (kv * head_dim, hidden),
                "v_proj": (kv * head_dim, hidden), "o_proj": (hidden, heads * head_dim)}
        for name, shape in attn.items():
            shapes[f"{p}self_attn.{name}.weight"] = shape
            if (o_bias if name == "o_proj" else qkv_bias):
                shapes[f"{p}self_attn.{name}.bias"] = shape[:1]
        if rules.get("qk_norm"):
            shapes[f"{p}self_attn.q_norm.weight"] = shapes[f"{p}self_attn.k_norm.weight"] = (head_dim,)
        shapes[f"{p}input_layernorm.weight"] = shapes[f"{p}post_attention_layernorm.weight"] = (hidden,)
        if rules.get("experts"):
            experts = _ints(config, "num_local_experts")
            if experts is None:
                return None
            shapes[f"{p}block_sparse_moe.gate.weight"] = (experts[0], hidden)
            for e in range(experts[0]):
                q = f"{p}block_sparse_moe.experts.{e}."
                shapes[f"{q}w1.weight"] = shapes[f"{q}w3.weight"] = (inter, hidden)
                shapes[f"{q}w2.weight"] = (hidden, inter)
            continue
        sparse = _sparse(config, i) if rules.get("routed") else False  # Qwen3-MoE: (experts, expert size)
        if sparse is None:
            return None
        if sparse:
            experts, size = sparse
            shapes[f"{p}mlp.gate.weight"] = (experts, hidden)
            for e in range(experts):
                q = f"{p}mlp.experts.{e}."
                shapes[f"{q}gate_proj.weight"] = shapes[f"{q}up_proj.weight"] = (size, hidden)
                shapes[f"{q}down_proj.weight"] = (hidden, size)
            continue
        mlp = {"gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}
        for name, shape in mlp.items():
            shapes[f"{p}mlp.{name}.weight"] = shape
            if mlp_bias:
                shapes[f"{p}mlp.{name}.bias"] = shape[:1]
    return shapes


def _sparse(config: dict, layer: int) -> tuple[int, int] | bool | None:
    """Whether Qwen3-MoE's layer `layer` routes to experts, as its decoder layer decides: (experts, each one's
    intermediate size), False for a dense MLP, None where config.json does not say (the class default would)."""
    named = [config[k] for k in ("num_experts", "num_local_experts") if k in config]  # the Hub's, transformers 5's
    experts = named[0] if named and named.count(named[0]) == len(named) else None
    step, dense = config.get("decoder_sparse_step"), config.get("mlp_only_layers")
    if not _positive(step) or not isinstance(dense, list) or not _positive(experts):
        return None
    if layer in dense or (layer + 1) % step:
        return False
    size = _ints(config, "moe_intermediate_size")
    return (experts, size[0]) if size else None


def _gpt2(config: dict) -> Shapes | None:
    dims = _ints(config, "n_embd", "n_layer", "n_head", "vocab_size", "n_positions")
    if dims is None or config.get("add_cross_attention"):
        return None  # cross-attention layers: parameters not modelled here
    embd, layers, heads, vocab, positions = dims
    inner = config.get("n_inner")
    inner = 4 * embd if inner is None else inner
    if not _positive(inner) or embd % heads:
        return None
    shapes: Shapes = {"transformer.wte.weight": (vocab, embd), "transformer.wpe.weight": (positions, embd),
                      "transformer.ln_f.weight": (embd,), "transformer.ln_f.bias": (embd,),
                      "lm_head.weight": (vocab, embd)}
    for i in range(layers):
        p = f"transformer.h.{i}."
        for norm in ("ln_1", "ln_2"):
            shapes[f"{p}{norm}.weight"] = shapes[f"{p}{norm}.bias"] = (embd,)
        # Conv1D stores [in, out]: the bias has the output size.
        for name, (n_in, n_out) in {"attn.c_attn": (embd, 3 * embd), "attn.c_proj": (embd, embd),
                                    "mlp.c_fc": (embd, inner), "mlp.c_proj": (inner, embd)}.items():
            shapes[f"{p}{name}.weight"] = (n_in, n_out)
            shapes[f"{p}{name}.bias"] = (n_out,)
    return shapes
