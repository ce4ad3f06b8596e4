"""LoRA kernels: every adapted linear's shrink and expand, for a batch whose tokens use different adapters.

- ``cpu``: one C++ call per linear (AVX2, FMA), float32.

Their reference is ``tokenmill.lora.kernels.TorchLoRAKernels``. Nothing is imported here.
"""

__all__ = ["cpu"]
