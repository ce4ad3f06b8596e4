"""The small operations between a layer's matmuls, each one kernel: RMSNorm with the residual add, rope,
SiLU times up.

- ``triton``: Triton kernels and their launchers (GPU; on CPU under ``TRITON_INTERPRET=1``).

Their reference is ``tokenmill.layers.kernels.TorchLayerKernels``. Nothing is imported here.
"""

__all__ = ["triton"]
