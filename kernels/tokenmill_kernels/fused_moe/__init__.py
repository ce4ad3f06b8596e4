"""Fused mixture-of-experts kernels: ``triton`` (GPUs; on CPU only under the Triton interpreter, for tests)."""
