"""bitsandbytes 4-bit: the on-disk contract in one module (`format`), which modules transformers quantizes
(`layout`), the quantizer choosing its kernel once (`quantize`: bitsandbytes on CUDA, prequant's own in
`kernels/` on the CPU, same bytes), and the error of a dequantized tensor (`stats`)."""
