"""Quantization kernels that run without bitsandbytes' CUDA build.

`prequant.bnb.kernels.cpu` is the public entry point: a CPU 4-bit quantizer (NF4/FP4, blockwise, with the
8-bit double quantization of the absmax statistics) whose bytes equal those of bitsandbytes' CUDA kernel.
The private modules beside it hold what that takes: the GPU's fast-math arithmetic (`_fastmath`), the
order in which torch's CUDA `mean` adds (`_cuda_mean`), the code tables (`_tables`), the 8-bit blockwise
quantization of double quant (`_dynamic8`), and a measured table of the GPU's approximate reciprocal
(`_mufu_rcp_table`). The work runs on a pool of threads (`_parallel`).
"""
