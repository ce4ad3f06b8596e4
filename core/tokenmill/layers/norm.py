"""RMSNorm, computed in float32 whatever the model's dtype (as the reference models do)."""

from __future__ import annotations

from typing import overload

import torch
from torch import nn

from tokenmill.layers.kernels import UsesLayerKernels


class RMSNorm(UsesLayerKernels):
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
        if residual is None:
            return self.layer_kernels.rms_norm(x, self.weight, self.eps)
        return self.layer_kernels.add_rms_norm(x, residual, self.weight, self.eps)
