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


class MergedLinear(Linear):
    """Several linears over the same input held as one (q/k/v, gate/up): one matmul per step
    instead of several, and a quantized kernel rounds the shared input once.

    The checkpoint stores the parts separately; they arrive one by one through ``load_shard``
    and reach the quantizer together, concatenated along the output dimension.
    """

    def __init__(
        self, in_features: int, shard_sizes: tuple[int, ...], bias: bool, quantizer: Quantizer, dtype: torch.dtype
    ) -> None:
        super().__init__(in_features, sum(shard_sizes), bias, quantizer, dtype)
        self.shard_sizes = shard_sizes
        self._pending: dict[str, list[torch.Tensor | None]] = {}

    def shard_shape(self, param_name: str, shard: int) -> tuple[int, ...]:
        """Shape of one part's checkpoint tensor for ``param_name``."""
        size = self.shard_sizes[shard]
        return (size, self.in_features) if param_name == "weight" else (size,)

    def load_shard(self, param_name: str, shard: int, tensor: torch.Tensor) -> None:
        """Keep one part; once every part of ``param_name`` is here, store them as one tensor."""
        parts = self._pending.setdefault(param_name, [None] * len(self.shard_sizes))
        parts[shard] = tensor
        if all(part is not None for part in parts):
            del self._pending[param_name]
            self.load_weight(param_name, torch.cat(parts, dim=0))  # type: ignore[arg-type]
