"""Write a small random Llama checkpoint (no network needed) to try prequant on.

    python scripts/make_tiny_checkpoint.py demo/tiny-llama [--hidden 256 --layers 4]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("output", type=Path)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--max-shard-size", default="2MB", help="shard the checkpoint like real ones are")
    args = parser.parse_args()
    config = LlamaConfig(
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 7 // 2,
        num_hidden_layers=args.layers,
        num_attention_heads=max(1, args.hidden // 64),
        num_key_value_heads=max(1, args.hidden // 128),
        vocab_size=args.vocab,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(args.output, max_shard_size=args.max_shard_size)
    (args.output / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 2048}))
    size = sum(p.stat().st_size for p in args.output.glob("*.safetensors"))
    print(f"wrote {args.output}: {sum(p.numel() for p in model.parameters()):,} parameters, {size / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
