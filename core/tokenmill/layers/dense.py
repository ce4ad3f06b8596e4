"""The built-in quantizer ``none``: dense weights in the model's dtype."""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers.quantizer import Quantizer, layer_bias, layer_tensor


class DenseQuantizer(Quantizer):
    name: ClassVar[str] = "none"
    is_dense: ClassVar[bool] = True

    def create_weights(
        self, layer: nn.Module, in_features: int, out_features: int, bias: bool, dtype: torch.dtype
    ) -> None:
        weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        layer.register_parameter("weight", weight)
        bias_param = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None
        layer.register_parameter("bias", bias_param)  # None declares it absent

    def load_weight(self, layer: nn.Module, param_name: str, tensor: torch.Tensor) -> None:
        layer_tensor(layer, param_name).data.copy_(tensor)

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer_tensor(layer, "weight"), layer_bias(layer))
