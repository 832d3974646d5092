"""What a checkpoint on disk is: tensor references (`tensors`), safetensors headers checked as strictly as
safetensors checks them (`safetensors`), the Hugging Face file names, index and config (`hf_files`), PyTorch
`.bin` shards read through `weights_only` (`binreader`), zero-copy reads of tensor data (`reader`), dtype names
(`dtypes`; bytes per element, torch-free, in `codes`) and prequant's own manifest format (`manifest`).

`hf_files` and this face are standard library only: the CLI reads a source's file list before torch loads."""
