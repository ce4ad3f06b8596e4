"""Layer kernels (slot ``layer_kernel``): the small operations between a layer's matmuls.

A decoder layer runs, besides its matmuls and attention, an RMSNorm with the residual add before it (twice), rope
over its queries and keys, and SiLU times the up projection. In torch each is several kernels: about 21 launches per
Llama layer. At batch 1 those launches (on a CPU, dispatches), not the bytes they move, are what they cost. A
``LayerKernels`` plugin does each in one kernel (the ``layer_kernels`` plugin: ``cpu`` and ``triton``). It may also
bring a dense matmul for the ``none`` quantizer's weights (``pack_dense_weight``, ``dense_linear``): the ``cpu``
kernels' reads a float32 weight once for up to 12 rows, which a decode step of a few requests or speculative tokens
needs and oneDNN's does not do (``tokenmill.layers.dense``).

``TorchLayerKernels`` (``torch``) is the reference, built in; it runs everywhere, and ``auto`` picks it where no
plugin's kernels run. The model loader selects one per process (``model.layer_kernels``) and hands it to every
module that calls them (``install_layer_kernels``); an architecture plugin whose modules subclass
``UsesLayerKernels`` gets the selected kernels without building them itself.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers.fast_module import FastModule

if TYPE_CHECKING:
    from tokenmill.attention.backend import AttentionBackend, AttentionMetadata


class SelectableKernels(ABC):
    """What a kernels plugin slot's implementations share: a name, the devices they run on, and how ``auto`` picks
    among them (layer kernels here, fused experts in ``tokenmill.layers.fused_experts``)."""

    #: Registered name.
    name: ClassVar[str]
    #: Device types it runs on.
    supported_devices: ClassVar[tuple[str, ...]] = ("cpu", "cuda")
    #: For ``"auto"``: the highest priority among those ``auto_selectable`` wins.
    auto_priority: ClassVar[int] = 0

    @classmethod
    def is_available(cls) -> bool:
        """Whether its dependencies are installed and a device it runs on is visible."""
        return True

    @classmethod
    def auto_selectable(cls, device: torch.device) -> bool:
        """Whether ``auto`` may pick it for a model on ``device``."""
        return device.type in cls.supported_devices and cls.is_available()


class LayerKernels(SelectableKernels):
    """The elementwise and normalisation kernels of a transformer layer, on tensors of the model's dtype.

    Built once per engine process (with no arguments, plus ``options=`` when its plugin declares options).
    Every method is called inside the forward, also while a CUDA graph is captured: it must not wait on the
    device or read a device value on the host. Results must match ``TorchLayerKernels`` up to float rounding
    (``tokenmill.testing.check_layer_kernels`` runs a plugin's against it); rounding to the model's dtype
    happens where the reference rounds.
    """

    @abstractmethod
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm of ``x`` [..., hidden] over its last dimension, scaled by ``weight`` [hidden]."""

    @abstractmethod
    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rms_norm(x + residual), x + residual)`` for ``x`` and ``residual`` [num_tokens, hidden], the sum
        rounded to their dtype first (as a layer's residual stream is)."""

    @abstractmethod
    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` for ``gate_up`` [num_tokens, 2 * inner] holding gate then up; [num_tokens, inner]."""

    @abstractmethod
    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rope ("rotate half") on ``x`` [num_tokens, heads, head_dim], whose last dimension is contiguous, with
        float32 ``cos`` and ``sin`` [num_tokens, 1, head_dim // 2]. May rotate ``x`` in place; returns the
        rotated tensor."""

    def gelu_tanh_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``gelu(gate, approximate="tanh") * up`` for ``gate_up`` [num_tokens, 2 * inner] holding gate then up;
        [num_tokens, inner] (Gemma's GeGLU). Optional: the default is torch's ops, which kernels without a fused
        GeGLU keep."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up

    def pack_dense_weight(self, weight: torch.Tensor) -> torch.Tensor | None:
        """``weight`` [out, in] in the layout :meth:`dense_linear` reads, or None where these kernels have no dense
        matmul for it (its dtype or device): the ``none`` quantizer then uses its own (oneDNN on the CPU, else
        ``F.linear``). Called on a layer's first forward without gradients, and again when the weight changes; the
        quantizer keeps the result."""
        return None

    def dense_linear(
        self, x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """``x @ W.T + bias`` -> [num_rows, out_features] for ``x`` [num_rows, in] contiguous and ``packed`` from
        :meth:`pack_dense_weight` (no gradient). Results within float32 rounding of ``F.linear``."""
        raise NotImplementedError(f"layer kernels {self.name!r} pack no dense weights")

    def fused_decoder(self, model: nn.Module, attention: AttentionBackend) -> FusedDecoder | None:
        """A runner of ``model``'s whole decoder stack in one call, or None (the default): the model's layers
        then run one module at a time, as they always may. Called once by the model loader, before the weights
        load; a kernels plugin returns one only for the models, quantizers and ``attention`` backends its runner
        reproduces exactly."""
        return None


class FusedDecoder(ABC):
    """A model's decoder layers and final norm in one call, for the steps it takes (``LayerKernels.fused_decoder``).

    The model calls it first each forward, after embedding the tokens and setting the step's rope positions;
    where it returns None the layers run as modules. Its result must equal theirs (tests compare them bit for
    bit): it is a way to run the same kernels without the interpreter between them, not other numerics. It must
    notice what changes the modules' results after it was built (weights loaded again, a quantizer replaced,
    LoRA adapters attached, a forward hook registered) and follow the modules.
    """

    @abstractmethod
    def __call__(
        self, hidden_states: torch.Tensor, kv_caches: list[torch.Tensor], metadata: AttentionMetadata
    ) -> torch.Tensor | None:
        """The final norm of the last layer's output [num_tokens, hidden] for the embeddings ``hidden_states``
        [num_tokens, hidden], or None for a step it does not take (a draft tree, a long prompt chunk, a forward
        hook on one of the modules, adapters it cannot add)."""


class TorchLayerKernels(LayerKernels):
    """The reference: torch operations, in float32 where the Hugging Face models compute in float32."""

    name: ClassVar[str] = "torch"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dtype == torch.float32:  # torch's fused kernel: one op instead of seven, same result
            return F.rms_norm(x, weight.shape, weight, eps)
        # bf16/fp16 (GPUs): normalised in float32, rounded to x's dtype, then scaled, as the reference models do.
        return weight * F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        total = x + residual
        return self.rms_norm(total, weight, eps), total

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class UsesLayerKernels(FastModule):
    """A module that calls layer kernels: it reads them from ``self.layer_kernels``, the torch reference until
    the model loader installs the selected ones (``install_layer_kernels``)."""

    layer_kernels: LayerKernels = TorchLayerKernels()


def install_layer_kernels(model: nn.Module, kernels: LayerKernels) -> None:
    """Make every ``UsesLayerKernels`` module of ``model`` call ``kernels``."""
    for module in model.modules():
        if isinstance(module, UsesLayerKernels):
            module.layer_kernels = kernels
