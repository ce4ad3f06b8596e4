"""Layer kernels plugin: ``triton`` (RMSNorm with the residual add, rope and SiLU times up, one kernel each)."""
