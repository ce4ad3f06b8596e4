"""Linear layers whose storage and matmul belong to a ``Quantizer``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from tokenmill.layers.kernels import UsesLayerKernels
from tokenmill.layers.quantizer import Quantizer

if TYPE_CHECKING:
    from tokenmill.lora.layers import LinearLoRA


@dataclass(frozen=True)
class LinearShard:
    """The slice of a checkpoint linear one tensor-parallel rank holds (``tokenmill.parallel``).

    ``dim`` 0 splits the output rows (column-parallel: q/k/v, gate/up, the output projection); ``dim`` 1
    splits the input columns (row-parallel: o_proj, down_proj), whose partial outputs the model sums over
    the shards, so only rank 0 keeps the bias.
    """

    dim: int
    rank: int
    size: int

    def take(self, tensor: torch.Tensor, dim: int, local_size: int) -> torch.Tensor:
        """This rank's ``local_size`` slice of ``tensor`` along ``dim``; raises ``ValueError`` when the
        checkpoint tensor is not ``size`` times that long there."""
        if tensor.shape[dim] != local_size * self.size:
            full = list(tensor.shape)
            full[dim] = local_size * self.size
            raise ValueError(f"has shape {list(tensor.shape)}, expected {full}")
        return tensor.narrow(dim, self.rank * local_size, local_size)


class Linear(UsesLayerKernels):
    """``y = x W^T + b`` with ``W`` held however the quantizer chooses.

    Checkpoint tensors arrive one at a time through :meth:`load_checkpoint_tensor`, in whatever order the
    checkpoint stores them: the weight's tensors (the quantizer's ``checkpoint_tensor_names``: a float
    ``weight``, or a quantized format's ``qweight``, ``scales``, ...) are kept until all are here, then read
    by the quantizer into one weight. The model's layer kernels are installed on it (``UsesLayerKernels``): the
    ``none`` quantizer multiplies with theirs where they bring a dense matmul.

    With a ``shard`` (tensor parallelism), ``in_features`` and ``out_features`` are this rank's: the quantizer
    reads each checkpoint module whole, then cuts this rank's share of it (``Quantizer.shard_weight``).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        quantizer: Quantizer,
        dtype: torch.dtype,
        shard: LinearShard | None = None,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.has_bias = bias
        self.shard = shard
        self.quantizer = quantizer
        quantizer.create_weights(self, in_features, out_features, bias, dtype)
        self._pending: dict[tuple[str, int], dict[str, torch.Tensor]] = {}  # (what, part) -> tensors so far
        self._parts: dict[str, list[Any]] = {}  # "weight" / "bias" -> each part's value, once read

    #: The output sizes of the checkpoint modules this layer holds, in order (one for a plain linear).
    @property
    def part_sizes(self) -> tuple[int, ...]:
        return (self.out_features,)

    def accepts(self, param_name: str) -> bool:
        """Whether a checkpoint tensor named ``<module>.<param_name>`` belongs to this layer."""
        return param_name == "bias" or param_name in self.quantizer.checkpoint_tensor_names

    def load_checkpoint_tensor(self, param_name: str, tensor: torch.Tensor, part: int = 0) -> None:
        """Take one checkpoint tensor of part ``part``; store the weight or bias once all of it is here.

        Raises ``ValueError`` for a tensor whose shape or type does not fit, with one line that reads on
        from the tensor's name, which the caller puts first ("has shape [3], expected [4]").
        """
        size = self.part_sizes[part]
        shard = self.shard
        if shard is not None:
            if param_name == "bias" and shard.dim == 1:  # summed over the shards: added once, by rank 0
                tensor = tensor if shard.rank == 0 else torch.zeros_like(tensor)
            elif param_name == "bias":
                tensor = shard.take(tensor, 0, size)
        if param_name == "bias":
            if tuple(tensor.shape) != (size,):
                raise ValueError(f"has shape {list(tensor.shape)}, expected {[size]}")
            self._collect("bias", part, tensor)
            return
        tensors = self._pending.setdefault(("weight", part), {})
        tensors[param_name] = tensor
        if tensors.keys() >= set(self.quantizer.checkpoint_tensor_names):
            del self._pending[("weight", part)]
            if shard is None:
                weight = self.quantizer.read_checkpoint(tensors, size, self.in_features)
            else:
                whole = (
                    (size * shard.size, self.in_features) if shard.dim == 0 else (size, self.in_features * shard.size)
                )
                weight = self.quantizer.read_checkpoint(tensors, *whole)
                weight = self.quantizer.shard_weight(weight, shard.dim, shard.rank, shard.size)
            self._collect("weight", part, weight)

    def _collect(self, what: str, part: int, value: Any) -> None:
        parts = self._parts.setdefault(what, [None] * len(self.part_sizes))
        parts[part] = value
        if all(p is not None for p in parts):
            del self._parts[what]
            if what == "bias":
                merged: Any = torch.cat(parts, dim=0)
            else:
                merged = parts[0] if len(parts) == 1 else self.quantizer.merge(parts)
            self.quantizer.load_weight(self, what, merged)

    def load_weight(self, param_name: str, tensor: torch.Tensor) -> None:
        """Store a whole float ``weight`` ``[out, in]`` or ``bias`` ``[out]`` directly (tests, tools)."""
        self.quantizer.load_weight(self, param_name, tensor)

    #: With LoRA enabled (``tokenmill.lora``): the adapters' slots, added on top of the quantizer's matmul.
    lora: LinearLoRA | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.lora is None:
            return self.quantizer.apply(self, x)
        return self.lora.apply(x, self.quantizer.apply(self, x))

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.has_bias}, quant={self.quantizer.name}"


class MergedLinear(Linear):
    """Several linears over the same input held as one (q/k/v, gate/up): one matmul per step
    instead of several, and a quantized kernel rounds the shared input once.

    The checkpoint stores the parts separately; each part's tensors arrive through
    ``load_checkpoint_tensor(..., part=i)`` and reach the quantizer together, stacked along the
    output dimension (by its ``merge``).
    """

    def __init__(
        self,
        in_features: int,
        shard_sizes: tuple[int, ...],
        bias: bool,
        quantizer: Quantizer,
        dtype: torch.dtype,
        shard: LinearShard | None = None,
    ) -> None:
        super().__init__(in_features, sum(shard_sizes), bias, quantizer, dtype, shard)
        self.shard_sizes = shard_sizes

    @property
    def part_sizes(self) -> tuple[int, ...]:
        return self.shard_sizes
