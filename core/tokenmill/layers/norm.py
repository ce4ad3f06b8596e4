"""RMSNorm, computed in float32 whatever the model's dtype (as the reference models do); Gemma's scales by
``1 + weight``."""

from __future__ import annotations

from typing import ClassVar, overload

import torch
from torch import nn

from tokenmill.layers.kernels import UsesLayerKernels


class RMSNorm(UsesLayerKernels):
    #: Added to ``weight`` before it scales (Gemma's norms store ``scale - 1``).
    weight_offset: ClassVar[float] = 0.0

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=dtype), requires_grad=False)

    @overload
    def forward(self, x: torch.Tensor) -> torch.Tensor: ...
    @overload
    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The norm of ``x``; with ``residual``, the norm of ``x + residual`` and that sum (one kernel where the
        layer kernels fuse them)."""
        weight: torch.Tensor = self.weight
        if self.weight_offset:  # [hidden], in float32 before rounding to the model's dtype: a few hundred floats
            weight = (weight.float() + self.weight_offset).to(weight.dtype)
        if residual is None:
            return self.layer_kernels.rms_norm(x, weight, self.eps)
        return self.layer_kernels.add_rms_norm(x, residual, weight, self.eps)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: the checkpoint stores ``weight`` as an offset from one and the norm scales by
    ``1 + weight`` (llama.cpp's converter stores ``1 + weight`` itself; its GGUF loader takes the one off)."""

    weight_offset: ClassVar[float] = 1.0
