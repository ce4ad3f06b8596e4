"""LoRA kernels (slot ``lora_kernel``): a batch's adapter products, whatever adapter each token uses.

A step's tokens may each use a different adapter (or none). The weights of the adapters in use sit in *slots*:
per adapted linear, ``lora_a`` ``[num_slots, rank, in]`` and ``lora_b`` ``[num_slots, out, rank]`` (the scaling
folded into B), and each token carries its slot (-1: no adapter). Every adapted linear then runs Punica's two
operations on top of its base matmul::

    h = shrink(x, lora_a)          # h[t] = lora_a[slot[t]] @ x[t]            [num_tokens, rank]
    expand(h, lora_b, y, offset)   # y[t, offset:offset + out] += lora_b[slot[t]] @ h[t]

Punica calls these SGMV (segments of tokens with one adapter: a prompt) and BGMV (one token each: decode).
``TorchLoRAKernels`` (``torch``) is the reference, built in: it groups the step's tokens by adapter once
(``prepare``) and runs one matmul per adapter in each. A plugin registers faster ones (a Triton SGMV, a CPU
kernel) through ``tokenmill_register_lora_kernels``; ``lora.lora_kernels`` selects one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import numpy
import torch


@dataclass(frozen=True)
class LoRABatch:
    """A step's tokens by adapter, as ``LoRAKernels.prepare`` laid them out; read by every adapted linear."""

    num_tokens: int
    #: ``[num_tokens]`` int64 on the device: each token's slot, -1 for none.
    token_slots: torch.Tensor
    #: For each slot in use: ``(slot, index)``, ``index`` the ``[n]`` int64 device tensor of its tokens, or None
    #: when the slot's tokens are all the batch's tokens.
    groups: tuple[tuple[int, torch.Tensor | None], ...]


class LoRAKernels(ABC):
    """Shrink and expand over a batch of tokens that use different adapters.

    Built once per engine process (with no arguments, plus ``options=`` when its plugin declares options).
    ``prepare`` runs once per step on the host before the forward; ``shrink`` and ``expand`` run inside the
    forward, once per adapted linear, and must not wait on the device or read device values on the host.
    Results must match ``TorchLoRAKernels`` up to float rounding.
    """

    #: Registered name.
    name: ClassVar[str]
    #: Device types it runs on.
    supported_devices: ClassVar[tuple[str, ...]] = ("cpu", "cuda")

    def prepare(self, token_slots: numpy.ndarray, device: torch.device) -> LoRABatch:
        """Lay out a step whose token ``t`` uses slot ``token_slots[t]`` (-1: no adapter); ``token_slots`` is
        ``[num_tokens]`` int64 on the host. The default groups the tokens by slot."""
        slots = numpy.unique(token_slots)
        groups: list[tuple[int, torch.Tensor | None]] = []
        for slot in slots[slots >= 0].tolist():
            where = numpy.flatnonzero(token_slots == slot)
            index = None if where.size == token_slots.size else torch.from_numpy(where).to(device)
            groups.append((int(slot), index))
        device_slots = torch.from_numpy(numpy.ascontiguousarray(token_slots, dtype=numpy.int64)).to(device)
        return LoRABatch(int(token_slots.size), device_slots, tuple(groups))

    @abstractmethod
    def shrink(self, batch: LoRABatch, x: torch.Tensor, lora_a: torch.Tensor) -> torch.Tensor:
        """``h[t] = lora_a[slot[t]] @ x[t]`` for ``x`` ``[num_tokens, in]`` and ``lora_a`` ``[num_slots, rank,
        in]``: ``[num_tokens, rank]`` in ``lora_a``'s dtype (rows of tokens without an adapter: anything finite)."""

    @abstractmethod
    def expand(self, batch: LoRABatch, h: torch.Tensor, lora_b: torch.Tensor, y: torch.Tensor, offset: int) -> None:
        """``y[t, offset:offset + out] += lora_b[slot[t]] @ h[t]`` in place for the tokens with an adapter, for
        ``h`` ``[num_tokens, rank]``, ``lora_b`` ``[num_slots, out, rank]`` and ``y`` ``[num_tokens, >= offset +
        out]`` (the base linear's output, in its own dtype)."""


class TorchLoRAKernels(LoRAKernels):
    """The reference: one matmul per adapter in the step, over that adapter's tokens (gathered when the step
    mixes adapters)."""

    name: ClassVar[str] = "torch"

    def shrink(self, batch: LoRABatch, x: torch.Tensor, lora_a: torch.Tensor) -> torch.Tensor:
        x = x.to(lora_a.dtype)
        if len(batch.groups) == 1 and batch.groups[0][1] is None:
            return x @ lora_a[batch.groups[0][0]].T
        h = x.new_zeros((x.shape[0], lora_a.shape[1]))  # [num_tokens, rank]
        for slot, index in batch.groups:
            assert index is not None, "a group of all tokens is the only group"
            h[index] = x[index] @ lora_a[slot].T
        return h

    def expand(self, batch: LoRABatch, h: torch.Tensor, lora_b: torch.Tensor, y: torch.Tensor, offset: int) -> None:
        target = y[:, offset : offset + lora_b.shape[1]]
        for slot, index in batch.groups:
            if index is None:
                target += (h @ lora_b[slot].T).to(y.dtype)
            else:
                target.index_add_(0, index, (h[index] @ lora_b[slot].T).to(y.dtype))
