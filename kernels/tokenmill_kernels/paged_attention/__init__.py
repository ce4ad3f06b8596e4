"""Attention over the paged KV cache: kernels and their plain-torch references.

- ``reference``: the per-request torch implementation every kernel is tested against.
- ``triton``: Triton kernels (cache write, decode with optional split-K, chunked prefill) and launchers.
- ``cpu``: AVX2 C++ kernels (``cpu/paged_attention.cpp``) for float32 on CPU, built on first use.
- ``cuda``: a CUDA decode kernel (``cuda/decode.cu``) compiled and launched through CuPy.

Nothing is imported here, so importing one module never pulls in Triton or CuPy for another.
"""

__all__ = ["cpu", "cuda", "reference", "triton"]
