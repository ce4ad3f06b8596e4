"""The built-in quantizer ``none``: dense weights in the model's dtype.

On the CPU in float32 the matmul runs on a copy of the weight packed once for it, rather than through
``F.linear``, which calls MKL's ``sgemm``: MKL takes a generic, slow code path on AMD CPUs.
``TOKENMILL_DENSE_CPU_MATMUL`` picks the packed matmul:

- ``kernels`` (the default): the layer kernels' own (``LayerKernels.pack_dense_weight``), which the loader installs
  on every ``Linear`` and on the embedding (``UsesLayerKernels``). The ``cpu`` layer kernels read the weight once
  for up to 12 input rows: one row streams the weights at the memory's speed, and the 2-12 rows of a step that
  verifies speculative tokens cost little more, where oneDNN's time grows with the rows
  (docs/benchmarks-history.md, "Dense float32 linears: the cpu layer kernels against oneDNN"). Layer kernels
  without a dense matmul (the ``torch`` reference) leave the layer to oneDNN.
- ``onednn``: oneDNN's linear (torch's private ``mkldnn`` ops) on its blocked layout, much faster than MKL on AMD
  CPUs (docs/benchmarks-history.md, "Dense float32 linears on the CPU: oneDNN against MKL").
- ``torch``: ``F.linear`` on the weight as loaded (the reference).

The packed copy is made on a layer's first forward without gradients and made again if the weight changes in
place (the AWQ pipeline scales weights between calibration passes); the plain ``weight`` stays, for the tied
embedding and for tools that read it, so a dense float32 model on the CPU holds its linear weights twice. A layer
is packed only while at least ``_KEEP_FREE`` bytes of memory would stay available after it: a model too large for
two copies runs the layers left over through ``F.linear`` (logged once) rather than running out of memory.
"""

from __future__ import annotations

import functools
import logging
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill import envs
from tokenmill.layers.kernels import LayerKernels
from tokenmill.layers.quantizer import Quantizer, layer_bias, layer_tensor
from tokenmill.memory import available_memory

#: Rows per matmul oneDNN packs the weight for: 16 keeps a few rows near one row's cost, and runs prompts faster
#: than a 1-row packing.
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
    """Whether oneDNN's packed linear (:func:`onednn_linear`) may be used: this torch has it and
    ``TOKENMILL_DENSE_CPU_MATMUL`` does not ask for ``F.linear``. (The Medusa trainer's projection uses it.)"""
    return envs.TOKENMILL_DENSE_CPU_MATMUL.get() != "torch" and _onednn_linear_available()


def cpu_matmul() -> str:
    """The float32 CPU matmul dense layers ask for: ``TOKENMILL_DENSE_CPU_MATMUL``, with ``onednn`` falling back to
    ``torch`` where this torch lacks oneDNN's packed linear (``kernels`` falls back per layer, see the module)."""
    choice = envs.TOKENMILL_DENSE_CPU_MATMUL.get()
    if choice == "onednn" and not _onednn_linear_available():
        _warn_no_onednn()
        return "torch"
    return choice


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
        self._cpu_matmul = cpu_matmul()

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
            self._cpu_matmul != "torch"
            and weight.dtype == torch.float32
            and x.dtype == torch.float32
            and weight.device.type == "cpu"
            and not (x.requires_grad or weight.requires_grad)
        ):
            kernels, packed = _packed(layer, weight, self._cpu_matmul)
            if kernels is not None and packed is not None:
                if x.dim() == 2:  # a step's rows: no reshape on the way in or out (121 calls a step)
                    return kernels.dense_linear(x.contiguous(), packed, weight.shape[0], layer_bias(layer))
                rows = x.reshape(-1, x.shape[-1]).contiguous()
                out = kernels.dense_linear(rows, packed, weight.shape[0], layer_bias(layer))
                return out.view(*x.shape[:-1], weight.shape[0])
            if packed is not None:
                return onednn_linear(x, packed, layer_bias(layer))
        return F.linear(x, weight, layer_bias(layer))


def _packed(layer: nn.Module, weight: torch.Tensor, matmul: str) -> tuple[LayerKernels | None, torch.Tensor | None]:
    """``weight`` packed for ``matmul`` (``kernels`` or ``onednn``): the layer kernels that packed it (None: oneDNN
    did) and the packed copy (None: too little memory for one, or no packed matmul here). Cached on ``layer`` and
    packed again when the weight's storage or its in-place version counter has changed since."""
    key = (weight.data_ptr(), weight._version, matmul)
    cached = layer.__dict__.get("_packed_weight")
    if cached is None or cached[0] != key:
        kernels: LayerKernels | None = None
        packed = None
        if available_memory(weight.device) - weight.numel() * weight.element_size() < _KEEP_FREE:
            _warn_unpacked()
        else:
            if matmul == "kernels":
                kernels = getattr(layer, "layer_kernels", None)
                with torch.no_grad():
                    packed = kernels.pack_dense_weight(weight) if kernels is not None else None
                if packed is None:
                    kernels = None
            if packed is None and _onednn_linear_available():
                packed = pack_for_onednn(weight)
        cached = (key, kernels, packed)
        layer.__dict__["_packed_weight"] = cached  # a plain attribute: not in state_dict, not moved by .to()
    return cached[1], cached[2]


@functools.cache  # once per process
def _warn_unpacked() -> None:
    logger.warning(
        "dense float32 layers: too little memory for packed copies of all of them (%.1f GiB must "
        "stay free); the rest run through F.linear, about half as fast on AMD CPUs",
        _KEEP_FREE / 2**30,
    )


@functools.cache  # once per process
def _warn_no_onednn() -> None:
    logger.warning("dense float32 layers: this torch has no oneDNN packed linear; F.linear stands in for it")
