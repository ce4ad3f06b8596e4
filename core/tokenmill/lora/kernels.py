"""LoRA kernels (slot ``lora_kernel``): a batch's adapter products, whatever adapter each token uses.

A step's tokens may each use a different adapter (or none). The weights of the adapters in use sit in *slots*:
per adapted linear, ``lora_a`` ``[num_slots, num_parts * rank, in]`` and, per part of a merged linear (q, k and v
of ``qkv_proj``), ``lora_b`` ``[num_slots, rank, out]`` (B transposed, the scaling folded in), and each token
carries its slot (-1: no adapter). Every adapted linear then runs Punica's two operations on top of its base
matmul, in one ``add_lora`` call::

    h = lora_a[slot[t]] @ x[t]                                     # shrink: [num_parts * rank]
    y[t, offset[p]:offset[p] + out_p] += h[p * rank:(p + 1) * rank] @ lora_b[p][slot[t]]   # expand, each part

Punica calls these SGMV (segments of tokens with one adapter: a prompt) and BGMV (one token each: decode).
A linear's slot tensors never move (an adapter is loaded into a slot in place), so each adapted linear asks its
kernels once for a function over them (``bind``); kernels whose calls cost more than their work at one token
check and lay out the weights there, once, instead of in every call.
``TorchLoRAKernels`` (``torch``) is the reference, built in: it groups the step's tokens by adapter once
(``prepare``) and runs one matmul per adapter and part. A plugin registers faster ones (a Triton SGMV, the ``cpu``
kernel) through ``tokenmill_register_lora_kernels``; ``lora.lora_kernels`` selects one, ``auto`` the fastest that
runs on the device.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar, TypeAlias

import numpy
import torch

from tokenmill.layers.kernels import SelectableKernels


@dataclass(frozen=True)
class LoRABatch:
    """A step's tokens by adapter, as ``LoRAKernels.prepare`` laid them out; read by every adapted linear."""

    num_tokens: int
    #: ``[num_tokens]`` int64 on the device: each token's slot, -1 for none.
    token_slots: torch.Tensor
    #: For each slot in use: ``(slot, index)``, ``index`` the ``[n]`` int64 device tensor of its tokens, or None
    #: when the slot's tokens are all the batch's tokens.
    groups: tuple[tuple[int, torch.Tensor | None], ...]


#: ``add(batch, x, y)``: one adapted linear's ``add_lora`` over the slot tensors it was bound to.
BoundLoRA: TypeAlias = Callable[[LoRABatch, torch.Tensor, torch.Tensor], None]


class LoRAKernels(SelectableKernels, ABC):
    """Shrink and expand over a batch of tokens that use different adapters.

    Built once per engine process (with no arguments, plus ``options=`` when its plugin declares options).
    ``prepare`` runs once per step on the host before the forward; ``add_lora`` (through the function ``bind``
    returned for the linear) runs inside the forward, once per adapted linear, and must not wait on the device or
    read device values on the host. Results must match
    ``TorchLoRAKernels`` up to float rounding (``tokenmill.testing.check_lora_kernels`` runs a plugin's against it).
    """

    def prepare(self, token_slots: numpy.ndarray, device: torch.device) -> LoRABatch:
        """Lay out a step whose token ``t`` uses slot ``token_slots[t]`` (-1: no adapter); ``token_slots`` is
        ``[num_tokens]`` int64 on the host. The default groups the tokens by slot."""
        # Not numpy.unique: its first call imports numpy.ma (tens of ms, on the engine loop).
        in_use = numpy.flatnonzero(numpy.bincount(token_slots + 1)[1:])  # slots >= 0 that hold a token, ascending
        groups: list[tuple[int, torch.Tensor | None]] = []
        for slot in in_use.tolist():
            where = numpy.flatnonzero(token_slots == slot)
            index = None if where.size == token_slots.size else torch.from_numpy(where).to(device)
            groups.append((int(slot), index))
        device_slots = torch.from_numpy(numpy.ascontiguousarray(token_slots, dtype=numpy.int64)).to(device)
        return LoRABatch(int(token_slots.size), device_slots, tuple(groups))

    def bind(self, lora_a: torch.Tensor, lora_b: Sequence[torch.Tensor], offsets: Sequence[int]) -> BoundLoRA:
        """``add(batch, x, y)``, the same as ``add_lora(batch, x, lora_a, lora_b, offsets, y)``; called once per
        adapted linear when its slots are made. The tensors keep their storage and shapes from then on (adapters
        are copied into them in place). The default calls ``add_lora``."""
        parts = tuple(lora_b)
        where = tuple(offsets)

        def add(batch: LoRABatch, x: torch.Tensor, y: torch.Tensor) -> None:
            self.add_lora(batch, x, lora_a, parts, where, y)

        return add

    @abstractmethod
    def add_lora(
        self,
        batch: LoRABatch,
        x: torch.Tensor,
        lora_a: torch.Tensor,
        lora_b: Sequence[torch.Tensor],
        offsets: Sequence[int],
        y: torch.Tensor,
    ) -> None:
        """Add each token's adapter product to ``y`` in place: for ``x`` ``[num_tokens, in]``, ``lora_a``
        ``[num_slots, num_parts * rank, in]`` and ``lora_b[p]`` ``[num_slots, rank, out_p]`` (one dtype, which
        may be narrower than ``x``'s: the products are in ``x``'s), ``y[t, offsets[p]:offsets[p] + out_p] +=
        (lora_a[s] @ x[t])[p * rank:(p + 1) * rank] @ lora_b[p][s]`` for each token ``t`` whose slot ``s`` is not
        -1. ``y`` ``[num_tokens, out]`` is the base
        linear's output, in its own dtype; tokens without an adapter keep their row."""


class TorchLoRAKernels(LoRAKernels):
    """The reference: per adapter in the step, one matmul for the shrink and one per part for the expand, over that
    adapter's tokens (gathered when the step mixes adapters)."""

    name: ClassVar[str] = "torch"

    def add_lora(
        self,
        batch: LoRABatch,
        x: torch.Tensor,
        lora_a: torch.Tensor,
        lora_b: Sequence[torch.Tensor],
        offsets: Sequence[int],
        y: torch.Tensor,
    ) -> None:
        rank = lora_a.shape[1] // len(lora_b)
        for slot, index in batch.groups:
            # In the activations' dtype (the adapters' may be narrower: --lora-dtype).
            h = (x if index is None else x[index]) @ lora_a[slot].T.to(x.dtype)  # [tokens, num_parts * rank]
            for part, (b, offset) in enumerate(zip(lora_b, offsets, strict=True)):
                delta = (h[:, part * rank : (part + 1) * rank] @ b[slot].to(x.dtype)).to(y.dtype)
                target = y[:, offset : offset + b.shape[2]]
                if index is None:
                    target += delta
                else:
                    target.index_add_(0, index, delta)
