"""LoRA kernels plugin: ``cpu`` (C++, AVX2) and ``triton`` (GPU): every adapted linear's shrink and expand in one
call (two Triton launches)."""
