"""Write a small random Llama checkpoint with its tokenizer (no network needed) to try prequant on; with --experts,
a Qwen3-MoE one (that many experts a layer, two per token) to try `--quantize-experts` and MoE training on.

    python scripts/make_tiny_checkpoint.py demo/tiny-llama [--hidden 256 --layers 4]
    python scripts/make_tiny_checkpoint.py demo/tiny-moe --experts 8

The tokenizer is a byte-level BPE trained here, in a fraction of a second, on the example conversations
(scripts/data/chats.jsonl), with a chat template, so the training examples run on the converted checkpoint. The
model's vocabulary is the tokenizer's.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast, Qwen3MoeConfig

CHATS = Path(__file__).resolve().parent / "data" / "chats.jsonl"
SPECIAL = ["<pad>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]  # ids 0, 1, 2, ...: LlamaConfig's
CHAT_TEMPLATE = ("{% for message in messages %}{{ '<|' + message['role'] + '|>\n' + message['content'] + '</s>\n' }}"
                 "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}")


def build_tokenizer(vocab: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE of at most `vocab` tokens (every text encodes: no unknown token) trained on the example
    conversations, with `SPECIAL` first and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    texts = [m["content"] for line in CHATS.read_text().splitlines() if line for m in json.loads(line)["messages"]]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIAL, show_progress=False,
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   additional_special_tokens=SPECIAL[3:], model_max_length=2048)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("output", type=Path)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=1024, help="the tokenizer's size at most (the corpus is small)")
    parser.add_argument("--experts", type=int, default=0, help="a Qwen3-MoE of this many experts a layer (0: Llama)")
    parser.add_argument("--max-shard-size", default="2MB", help="shard the checkpoint like real ones are")
    args = parser.parse_args()
    tokenizer = build_tokenizer(args.vocab)
    sizes = dict(
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 7 // 2,
        num_hidden_layers=args.layers,
        num_attention_heads=max(1, args.hidden // 64),
        num_key_value_heads=max(1, args.hidden // 128),
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    if args.experts:
        config = Qwen3MoeConfig(**sizes, head_dim=64, num_experts=args.experts, num_experts_per_tok=2,
                                moe_intermediate_size=args.hidden)
    else:
        config = LlamaConfig(**sizes)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(args.output, max_shard_size=args.max_shard_size)
    tokenizer.save_pretrained(args.output)
    size = sum(p.stat().st_size for p in args.output.glob("*.safetensors"))
    print(f"wrote {args.output}: {sum(p.numel() for p in model.parameters()):,} parameters, {size / 1e6:.1f} MB, "
          f"a tokenizer of {len(tokenizer)} tokens")


if __name__ == "__main__":
    main()
