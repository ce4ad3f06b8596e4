"""The quantizer interface: how a linear layer's weights are stored and multiplied."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch
from torch import nn


class Quantizer(ABC):
    """Owns the parameters of every ``tokenmill.layers.Linear`` of a model.

    Built once per engine process with no arguments, selected by
    ``model.quantization``. ``create_weights`` and ``load_weight`` run at model
    load; ``apply`` runs in every forward and must not allocate persistent
    state or call hooks.
    """

    #: Registered name.
    name: ClassVar[str]

    @abstractmethod
    def create_weights(
        self, layer: nn.Module, in_features: int, out_features: int, bias: bool, dtype: torch.dtype
    ) -> None:
        """Register the layer's parameters (``weight``, and ``bias`` when asked) on ``layer``."""

    @abstractmethod
    def load_weight(self, layer: nn.Module, param_name: str, tensor: torch.Tensor) -> None:
        """Store a checkpoint tensor (``"weight"`` ``[out, in]`` or ``"bias"`` ``[out]``) into the layer,
        converting or quantizing it. The caller has checked its shape."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``x @ weight.T + bias`` for ``x`` of shape ``[num_tokens, in_features]``."""
