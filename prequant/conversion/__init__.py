"""The conversion: `convert()` in `run.py` reads as the pipeline, one named step per line.

Its parts, in the order the data flows: `options` (ConvertOptions), `layout_worker` (the layout decided in a
child process while torch loads), `plan` (pure: every output tensor and shard before any data is read),
`readahead` (the disk kept busy), `pipeline` (read, quantize and write overlapped) with `shardset` (its output
shards, journaled) and `writer` (one streaming safetensors shard), `journal` (resume), `sidecar` (config, index,
side files), `record` (prequant.json and the hashes) with `card` (README.md), `output` (staging and publish),
`summary` (what was done).

(The package is named `conversion`, not `convert`, so that `prequant.convert` stays the function.) This face
imports nothing: the CLI uses `layout_worker` and `readahead` before torch is imported."""
