"""Weight-only quantizers for CPU: linear layers kept as 8-bit or 4-bit groups and multiplied by
the AVX2 kernels in ``tokenmill_kernels.quant_matmul``."""
