"""The built-in quantizer ``none``: dense weights in the model's dtype."""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers.quantizer import Quantizer


class DenseQuantizer(Quantizer):
    name: ClassVar[str] = "none"
    is_dense: ClassVar[bool] = True

    def create_weights(
        self, layer: nn.Module, in_features: int, out_features: int, bias: bool, dtype: torch.dtype
    ) -> None:
        layer.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        layer.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None

    def load_weight(self, layer: nn.Module, param_name: str, tensor: torch.Tensor) -> None:
        getattr(layer, param_name).data.copy_(tensor)

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.weight, layer.bias)
