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
    #: Stored weight types (GGUF tensor type names, e.g. ``"Q4_1"``) this quantizer holds exactly,
    #: so that loading such a checkpoint through it loses nothing. ``quantization = "auto"`` picks a
    #: quantizer by this list, preferring the highest ``auto_priority``.
    lossless_for: ClassVar[tuple[str, ...]] = ()
    auto_priority: ClassVar[int] = 0
    #: Whether the layer keeps a plain ``weight`` in the model's dtype (lets a tied output
    #: projection read the embedding instead of a copy).
    is_dense: ClassVar[bool] = False
    #: Devices whose tensors ``apply`` accepts.
    supported_devices: ClassVar[tuple[str, ...]] = ("cpu", "cuda")

    @classmethod
    def is_available(cls) -> bool:
        """Whether this machine can run it (CPU features, compiler, GPU libraries). Called at
        start-up by ``quantization = "auto"`` before choosing it; must be cheap and must not raise."""
        return True

    def output_quantizer(self) -> Quantizer:
        """The quantizer for the model's output projection (``lm_head``). Called once at model build.

        The default is this quantizer. A low-bit quantizer may return a higher-precision one,
        as GGUF files keep their output projection at 8 bits when the rest is 4-bit.
        """
        return self

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


# A type checker reads any ``nn.Module`` attribute as ``Tensor | Module``; these read back what a
# quantizer registered on its layer as what it is (an assert each, in every forward).


def layer_tensor(layer: nn.Module, name: str) -> torch.Tensor:
    """The parameter or buffer ``name`` that the quantizer registered on ``layer``."""
    value = getattr(layer, name)
    assert isinstance(value, torch.Tensor), f"{type(layer).__name__}.{name} is a {type(value).__name__}"
    return value


def layer_bias(layer: nn.Module) -> torch.Tensor | None:
    """``layer``'s ``bias``: None when the quantizer registered it as absent."""
    bias = getattr(layer, "bias", None)
    assert bias is None or isinstance(bias, torch.Tensor), f"{type(layer).__name__}.bias is a {type(bias).__name__}"
    return bias
