"""The quantizer interface: how a linear layer's weights are stored and multiplied."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

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
    #: Stored weight types it holds on a finer grid than theirs, within its own rounding (an 8-bit quantizer for
    #: a 4- or 6-bit GGUF type): ``quantization = "auto"`` picks it where none holds the checkpoint exactly.
    near_lossless_for: ClassVar[tuple[str, ...]] = ()
    auto_priority: ClassVar[int] = 0
    #: Whether the layer keeps a plain ``weight`` in the model's dtype (lets a tied output
    #: projection read the embedding instead of a copy).
    is_dense: ClassVar[bool] = False
    #: Devices whose tensors ``apply`` accepts.
    supported_devices: ClassVar[tuple[str, ...]] = ("cpu", "cuda")
    #: The ``quantization_config.quant_method`` values of Hugging Face checkpoints this quantizer reads
    #: (``"gptq"``, ``"awq"``, ``"compressed-tensors"``): ``quantization = "auto"`` picks it for them.
    quant_methods: ClassVar[tuple[str, ...]] = ()
    #: The tensors one linear layer stores in the checkpoint, besides ``bias`` (``("qweight", "qzeros",
    #: "scales", "g_idx")`` for GPTQ); :meth:`configure` may set them from the checkpoint's config.
    checkpoint_tensor_names: tuple[str, ...] = ("weight",)
    #: Input columns stored together (a block with one scale): a tensor-parallel split of a linear's input
    #: (o_proj, down_proj) must give every shard whole groups. :meth:`configure` may set it from the checkpoint.
    input_group_size: int = 1

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

    def configure(self, quantization_config: Mapping[str, Any]) -> None:
        """Read a checkpoint's ``quantization_config`` (its ``config.json`` entry). Called once, before the
        model is built, for checkpoints whose ``quant_method`` is in :attr:`quant_methods`.

        Raises ``ValueError`` with one line naming the variant and what is supported when the checkpoint
        uses one this quantizer cannot run, so that nothing is loaded in vain.
        """
        raise ValueError(f"quantizer {self.name!r} does not read quantized checkpoints")

    def leaves_unquantized(self, module_name: str) -> bool:
        """Whether the checkpoint left linear ``module_name`` (its Hugging Face name) in float, as a
        compressed-tensors ``ignore`` list does. Called once per linear at load: a model runs one quantizer, so
        the loader refuses a checkpoint that leaves out a linear other than ``lm_head``. Modules the model does
        not build as linears (MoE routers) may be left out freely."""
        return False

    def read_checkpoint(self, tensors: Mapping[str, torch.Tensor], out_features: int, in_features: int) -> Any:
        """One checkpoint module's weight from its tensors (:attr:`checkpoint_tensor_names`, all present), for
        a linear of that shape. Called once per checkpoint module at load. The default reads a float ``weight``.

        Raises ``ValueError`` for tensors whose shape or type does not fit, with one line that reads on from
        the name of the tensor that completed the set, which the caller puts first ("has shape [3, 4], ...";
        "belongs to a module whose 'qzeros' is ...").
        """
        weight = tensors["weight"]
        if tuple(weight.shape) != (out_features, in_features):
            raise ValueError(f"has shape {list(weight.shape)}, expected {[out_features, in_features]}")
        return weight

    def shard_weight(self, weight: Any, dim: int, rank: int, size: int) -> Any:
        """Tensor-parallel rank ``rank``'s part of a weight that :meth:`read_checkpoint` read whole: its share of
        the output rows (``dim`` 0) or input columns (``dim`` 1), of ``size`` equal shares. Called once per
        checkpoint module at load under tensor parallelism, before :meth:`merge`. The default cuts a float
        weight; raises ``ValueError`` (one line, as :meth:`read_checkpoint`) where a share cannot be cut."""
        count = weight.shape[dim] // size
        return weight.narrow(dim, rank * count, count)

    def merge(self, parts: Sequence[Any]) -> Any:
        """What :meth:`read_checkpoint` returned for the parts of a merged linear (q, k, v), as one weight
        stacked along the output dimension. Called once per merged linear at load."""
        return torch.cat(list(parts), dim=0)

    @abstractmethod
    def create_weights(
        self, layer: nn.Module, in_features: int, out_features: int, bias: bool, dtype: torch.dtype
    ) -> None:
        """Register the layer's parameters (``weight``, and ``bias`` when asked) on ``layer``."""

    @abstractmethod
    def load_weight(self, layer: nn.Module, param_name: str, tensor: Any) -> None:
        """Store ``"weight"`` (what :meth:`read_checkpoint` or :meth:`merge` returned; a float ``[out, in]``
        tensor by default) or ``"bias"`` (``[out]``) into the layer, converting or quantizing it."""

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
