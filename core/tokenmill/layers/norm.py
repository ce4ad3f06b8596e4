"""RMSNorm, computed in float32 whatever the model's dtype (as the reference models do)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # torch's fused kernel: one op instead of seven, same result
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # bf16/fp16 (GPUs): normalised in float32, rounded to x's dtype, then scaled, as the reference models do.
        # The normalisation is torch's fused kernel on CUDA: four kernels instead of eight, where a profile on an
        # H200 found a Llama-3-8B decode step spending ~0.8 ms of 6.4 in small elementwise kernels.
        return self.weight * F.rms_norm(x.float(), self.weight.shape, None, self.eps).to(x.dtype)
