"""Linear layers whose storage and matmul belong to a ``Quantizer``."""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.layers.quantizer import Quantizer


class Linear(nn.Module):
    """``y = x W^T + b`` with ``W`` held however the quantizer chooses."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, quantizer: Quantizer, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.has_bias = bias
        self.quantizer = quantizer
        quantizer.create_weights(self, in_features, out_features, bias, dtype)

    def expected_shape(self, param_name: str) -> tuple[int, ...]:
        """Shape of the checkpoint tensor for ``param_name``, before any quantization."""
        return (self.out_features, self.in_features) if param_name == "weight" else (self.out_features,)

    def load_weight(self, param_name: str, tensor: torch.Tensor) -> None:
        self.quantizer.load_weight(self, param_name, tensor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quantizer.apply(self, x)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.has_bias}, quant={self.quantizer.name}"
