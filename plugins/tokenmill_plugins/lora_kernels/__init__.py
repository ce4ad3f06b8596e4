"""LoRA kernels plugin: ``cpu`` (C++, AVX2): every adapted linear's shrink and expand in one call."""
