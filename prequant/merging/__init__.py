"""`prequant merge`: a LoRA adapter merged into its base (16-bit, FP8 or 4-bit), streaming one tensor at a time.
Named `merging` so that `prequant.merge` stays the function."""
