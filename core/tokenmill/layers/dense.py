"""The built-in quantizer ``none``: dense weights in the model's dtype.

On the CPU in float32 the matmul runs through oneDNN (torch's ``mkldnn`` ops) on a copy of the weight
packed into oneDNN's blocked layout, rather than through ``F.linear``, which calls MKL's ``sgemm``. MKL
takes a generic code path on AMD CPUs: on a 2-core AMD EPYC (Zen 5) ``F.linear`` reads a model's weights
at 17 GB/s one token at a time where oneDNN reads them at 38-47 GB/s, and prefills at about 200 against
370-490 GFLOP/s (docs/benchmarks.md, "Dense float32 linears on the CPU"). The packed copy is made on a
layer's first forward without gradients and made again if the weight changes in place (the AWQ pipeline
scales weights between calibration passes); the plain ``weight`` stays, for the tied embedding and for
tools that read it, so a dense float32 model on the CPU holds its linear weights twice. A layer is packed only
while at least ``_KEEP_FREE`` bytes of memory would stay available after it: a model too large for two copies
runs the layers left over through ``F.linear`` (logged once) rather than running out of memory.
``TOKENMILL_DENSE_CPU_MATMUL=torch`` turns the oneDNN path off (the ``F.linear`` reference).
"""

from __future__ import annotations

import functools
import logging
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill import envs
from tokenmill.layers.quantizer import Quantizer, layer_bias, layer_tensor
from tokenmill.memory import available_memory

#: Rows per matmul oneDNN packs the weight for. Measured on the development machine (60 MLP-shaped weights):
#: with 16, 2 to 8 rows cost 1.04-1.16x one row, and 2,048 rows 281 ms; with 1, 2 rows cost 1.4x and 2,048 304 ms.
_PACK_FOR_ROWS = 16
#: Memory a packed copy must leave available (requests' activations and the rest of the process grow later).
_KEEP_FREE = 2 * 2**30

logger = logging.getLogger(__name__)


def _onednn_linear_available() -> bool:
    """Whether this torch has oneDNN's packed linear (a private op that torch's own compiler uses on CPU)."""
    ops = torch.ops.mkldnn
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(ops, "_linear_pointwise")
        and hasattr(ops, "_reorder_linear_weight")
    )


def onednn_enabled() -> bool:
    """Whether float32 CPU matmuls should use :func:`onednn_linear`: ``TOKENMILL_DENSE_CPU_MATMUL`` asks for
    oneDNN and this torch has its packed linear."""
    return envs.TOKENMILL_DENSE_CPU_MATMUL.get() == "onednn" and _onednn_linear_available()


def pack_for_onednn(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [out, in] (float32, CPU) packed for :func:`onednn_linear` (when :func:`onednn_enabled`)."""
    with torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_FOR_ROWS)


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` for ``packed`` from :func:`pack_for_onednn` (no gradient)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class DenseQuantizer(Quantizer):
    name: ClassVar[str] = "none"
    is_dense: ClassVar[bool] = True

    def __init__(self) -> None:
        self._use_onednn = onednn_enabled()

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
        weight = layer_tensor(layer, "weight")
        if (
            self._use_onednn
            and weight.dtype == torch.float32
            and x.dtype == torch.float32
            and weight.device.type == "cpu"
            and not (x.requires_grad or weight.requires_grad)
        ):
            packed = _packed(layer, weight)
            if packed is not None:
                return onednn_linear(x, packed, layer_bias(layer))
        return F.linear(x, weight, layer_bias(layer))


def _packed(layer: nn.Module, weight: torch.Tensor) -> torch.Tensor | None:
    """``weight`` in oneDNN's layout, cached on ``layer`` and packed again when the weight's storage or its
    in-place version counter has changed since; None (also cached) when a copy would leave too little memory."""
    key = (weight.data_ptr(), weight._version)
    cached = layer.__dict__.get("_onednn_weight")
    if cached is None or cached[0] != key:
        packed = None
        if available_memory(weight.device) - weight.numel() * weight.element_size() >= _KEEP_FREE:
            packed = pack_for_onednn(weight)
        else:
            _warn_unpacked()
        cached = (key, packed)
        layer.__dict__["_onednn_weight"] = cached  # a plain attribute: not in state_dict, not moved by .to()
    return cached[1]


@functools.cache  # once per process
def _warn_unpacked() -> None:
    logger.warning(
        "dense float32 layers: too little memory for oneDNN's packed copies of all of them (%.1f GiB must "
        "stay free); the rest run through F.linear, about half as fast on AMD CPUs",
        _KEEP_FREE / 2**30,
    )
