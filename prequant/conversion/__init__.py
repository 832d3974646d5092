"""The conversion: `convert()` in `run.py` reads as the pipeline, one named step per line.

Its parts, in the order the data flows: `options` (ConvertOptions), `plan` (pure: every output tensor and shard
before any data is read), `output` (OUTPUT_DIR checked, claimed, staged, published), `journal` (what a rerun
continues), `readahead` (the disk kept busy), `pipeline` (read, quantize and write overlapped: files to the GPU
through pinned buffers, output shards journaled) and `writer` (one streaming safetensors shard, `follow_hash` its
sha256 as it is written), `record` (config, index, side files, NaN and Inf in the kept tensors, the hashes and
prequant.json) with `card` (README.md), `summary` (what was done).

(The package is named `conversion`, not `convert`, so that `prequant.convert` stays the function.) This face
imports nothing: the CLI checks OUTPUT_DIR with `output` before torch is imported."""
