"""LoRA kernels: every adapted linear's shrink and expand, for a batch whose tokens use different adapters.

- ``cpu``: one C++ call per linear (AVX2, FMA), float32.
- ``triton``: two Triton launches per linear (GPU; on CPU under ``TRITON_INTERPRET=1``).

Their reference is ``tokenmill.lora.kernels.TorchLoRAKernels``. Nothing is imported here.
"""

__all__ = ["cpu", "triton"]
