"""Dense float32 matmul for CPU decoding: weights packed into panels, read once for every input row of a step."""

from __future__ import annotations

from tokenmill_kernels.dense_matmul.cpu import PANEL, is_available, linear, load, pack

__all__ = ["PANEL", "is_available", "linear", "load", "pack"]
