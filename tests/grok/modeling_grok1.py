"""A tiny Grok-1-style MoE model for tests: 8-expert-style top-k routing, nn.Linear experts, and the
parameter names of either published port (keyfan/grok-1-hf or hpcai-tech/grok-1). Written for prequant's
tests, not a faithful Grok-1 (no rotary embeddings, no attention/logit soft-capping, no padding mask: batches are
unpadded). Its interface is a transformers causal LM's, as both ports' is: a body (`base_model`) returning
`last_hidden_state`, forwards taking the usual keyword arguments, `generate`, activation checkpointing per decoder
layer; so peft, Trainer and TRL can drive it."""

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutput, CausalLMOutput

from .configuration_grok1 import Grok1Config

# Attribute names per naming: model body, embedding, layers, final norm, attention q/k/v/o, router,
# experts container, layer norms (pre-attn, post-attn, pre-moe, post-moe).
NAMES = {
    "keyfan": dict(body="transformer", embed="in_out_embed", layers="decoder_layer", norm="rms_norm",
                   attn="multi_head_attention", qkvo=("query", "key", "value", "linear"),
                   norms=("rms_norm", "rms_norm_1", "rms_norm_2", "rms_norm_3")),
    "hpcai": dict(body="model", embed="embed_tokens", layers="layers", norm="norm", attn="attn",
                  qkvo=("q_proj", "k_proj", "v_proj", "o_proj"),
                  norms=("pre_attn_norm", "post_attn_norm", "pre_moe_norm", "post_moe_norm")),
}


class RMSNorm(nn.Module):
    def __init__(self, size, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * self.weight.float()).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, c, names):
        super().__init__()
        self.heads, self.kv_heads = c.num_attention_heads, c.num_key_value_heads
        self.head_dim = c.hidden_size // c.num_attention_heads
        q, k, v, o = names["qkvo"]
        self.names = (q, k, v, o)
        setattr(self, q, nn.Linear(c.hidden_size, self.heads * self.head_dim, bias=False))
        setattr(self, k, nn.Linear(c.hidden_size, self.kv_heads * self.head_dim, bias=False))
        setattr(self, v, nn.Linear(c.hidden_size, self.kv_heads * self.head_dim, bias=False))
        setattr(self, o, nn.Linear(self.heads * self.head_dim, c.hidden_size, bias=False))

    def forward(self, x):
        q_, k_, v_, o_ = (getattr(self, n) for n in self.names)
        b, t, _ = x.shape
        q = q_(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = k_(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = v_(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return o_(y.transpose(1, 2).reshape(b, t, -1))


class Expert(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.linear = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.linear_v = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.linear_1 = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        return self.linear_1(F.gelu(self.linear(x)) * self.linear_v(x))


def moe(x, router, experts, k):
    logits = router(x).float()
    weights, chosen = torch.topk(F.softmax(logits, dim=-1), k, dim=-1)
    out = torch.zeros_like(x)
    for e, expert in enumerate(experts):
        mask = chosen == e
        if mask.any():
            w = (weights * mask).sum(-1, keepdim=True).to(x.dtype)
            out = out + w * expert(x)
    return out


class MoEBlock(nn.Module):  # hpcai naming: moe_block.gate + moe_block.experts.E
    def __init__(self, c):
        super().__init__()
        self.gate = nn.Linear(c.hidden_size, c.num_experts, bias=False)
        self.experts = nn.ModuleList(Expert(c) for _ in range(c.num_experts))
        self.k = c.num_experts_per_tok

    def forward(self, x):
        return moe(x, self.gate, self.experts, self.k)


class DecoderLayer(GradientCheckpointingLayer):
    def __init__(self, c, names):
        super().__init__()
        self.naming, self.k = c.naming, c.num_experts_per_tok
        self.norm_names = names["norms"]
        for n in self.norm_names:
            setattr(self, n, RMSNorm(c.hidden_size, c.rms_norm_eps))
        setattr(self, names["attn"], Attention(c, names))
        self.attn_name = names["attn"]
        if c.naming == "keyfan":  # router at layer level, experts as moe.E
            self.router = nn.Linear(c.hidden_size, c.num_experts, bias=False)
            self.moe = nn.ModuleList(Expert(c) for _ in range(c.num_experts))
        else:
            self.moe_block = MoEBlock(c)

    def forward(self, x):
        n1, n2, n3, n4 = (getattr(self, n) for n in self.norm_names)
        x = x + n2(getattr(self, self.attn_name)(n1(x)))
        h = n3(x)
        h = moe(h, self.router, self.moe, self.k) if self.naming == "keyfan" else self.moe_block(h)
        return x + n4(h)


class Body(nn.Module):
    def __init__(self, c, names):
        super().__init__()
        self.names = names
        setattr(self, names["embed"], nn.Embedding(c.vocab_size, c.hidden_size))
        setattr(self, names["layers"], nn.ModuleList(DecoderLayer(c, names) for _ in range(c.num_hidden_layers)))
        setattr(self, names["norm"], RMSNorm(c.hidden_size, c.rms_norm_eps))

    def forward(self, input_ids=None, **kwargs):
        x = getattr(self, self.names["embed"])(input_ids)
        for layer in getattr(self, self.names["layers"]):
            x = layer(x)
        return BaseModelOutput(last_hidden_state=getattr(self, self.names["norm"])(x))


class Grok1ModelForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = Grok1Config
    base_model_prefix = "transformer"
    _no_split_modules = ["DecoderLayer"]
    supports_gradient_checkpointing = True

    def __init__(self, config):
        super().__init__(config)
        names = NAMES[config.naming]
        self.body_name = names["body"]
        setattr(self, names["body"], Body(config, names))
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.data.normal_(0.0, 0.02)

    @property
    def base_model(self):  # the body under either naming (hpcai's is `model`, not the class's prefix)
        return getattr(self, getattr(self, "body_name", ""), self)

    def get_input_embeddings(self):
        body = getattr(self, self.body_name)
        return getattr(body, body.names["embed"])

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
        logits = self.lm_head(self.base_model(input_ids).last_hidden_state).float()
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1))
        return CausalLMOutput(loss=loss, logits=logits)
