"""Quantizers for CPU: linear layers quantized at load to 8-bit or 4-bit groups (``int8``, ``int4``), and
checkpoints quantized by other tools (``gptq``, ``awq``, ``compressed-tensors``) repacked for the same kernels in
``tokenmill_kernels.quant_matmul``."""
