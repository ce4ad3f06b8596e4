"""Layer kernels plugin: ``cpu`` (C++, AVX2) and ``triton`` (GPU): RMSNorm with the residual add, rope and
(triton) SiLU times up, one kernel each."""
