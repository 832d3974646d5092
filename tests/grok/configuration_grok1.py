"""A tiny Grok-1-style config for tests (remote code, referenced through auto_map)."""

from transformers import PretrainedConfig


class Grok1Config(PretrainedConfig):
    model_type = "grok-1"

    def __init__(
        self,
        vocab_size: int = 256,
        hidden_size: int = 64,
        intermediate_size: int = 128,
        num_hidden_layers: int = 2,
        num_attention_heads: int = 4,
        num_key_value_heads: int = 2,
        num_experts: int = 4,
        num_experts_per_tok: int = 2,
        rms_norm_eps: float = 1e-5,
        naming: str = "keyfan",  # "keyfan" (keyfan/grok-1-hf) or "hpcai" (hpcai-tech/grok-1)
        tie_word_embeddings: bool = False,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.num_experts = num_experts
        self.num_experts_per_tok = num_experts_per_tok
        self.rms_norm_eps = rms_norm_eps
        self.naming = naming
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
