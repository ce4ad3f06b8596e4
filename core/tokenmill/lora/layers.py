"""``LinearLoRA``: the adapter slots of one linear layer, added on top of its base matmul.

A ``tokenmill.layers.Linear`` holds one of these in ``lora`` when LoRA is enabled (``LoRAManager`` installs them).
A merged linear (``qkv_proj``: q, k and v; ``gate_up_proj``: gate and up) holds the adapters of each of its parts:
one ``lora_a`` for all parts, their ranks side by side, so one shrink serves them, and one ``lora_b`` per part,
stored transposed (``[rank, out]``: an expand reads whole rows), expanded into that part's columns of the merged
output. Ranks below ``max_lora_rank`` are zero-padded, and the scaling is folded into B. The base matmul stays the
quantizer's, whatever it stores (float, int4, int8, GPTQ).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from itertools import accumulate

import numpy
import torch

from tokenmill.lora.kernels import LoRABatch, LoRAKernels


@dataclass
class LoRAContext:
    """What every adapted linear of a model reads in a forward: the kernels, and the step's layout by adapter
    (None: no token of the step uses an adapter). Set by ``LoRAManager.set_step`` once per step."""

    kernels: LoRAKernels
    batch: LoRABatch | None = field(default=None)


class RoutedLoRA:
    """The adapters of a mixture of experts' routed experts. Each expert runs over the tokens routed to it, not the
    step's, so its linears read their own ``context``, whose layout the fused experts kernels set before each
    expert runs: ``route`` once per layer with each (token, expert) pair's token, grouped by expert, then
    ``select`` per expert with its pairs. ``LoRAManager`` sets ``step_slots`` each step."""

    def __init__(self, kernels: LoRAKernels, device: torch.device) -> None:
        self.context = LoRAContext(kernels)
        self.device = device
        #: ``[num_tokens]`` int64 on the host: each of the step's tokens' slot (-1: none); None: no adapter.
        self.step_slots: numpy.ndarray | None = None
        self._pair_slots: numpy.ndarray | None = None

    def route(self, token_of_pair: torch.Tensor) -> None:
        """A MoE layer's pairs, grouped by expert: ``token_of_pair`` ``[num_pairs]`` int64 (any device), each
        pair's token in the step. Reads it on the host when the step has adapters."""
        steps = self.step_slots
        self._pair_slots = None if steps is None else steps[token_of_pair.cpu().numpy()]
        self.context.batch = None

    def select(self, start: int, end: int) -> None:
        """The next expert runs on pairs ``start:end`` of the last ``route`` (an empty range: none)."""
        slots = None if self._pair_slots is None else self._pair_slots[start:end]
        if slots is None or not (slots >= 0).any():
            self.context.batch = None
        else:
            self.context.batch = self.context.kernels.prepare(slots, self.device)


class LinearLoRA:
    """Slots of adapter weights for one (possibly merged) linear of ``in_features`` inputs and ``part_sizes``
    outputs per part: zeros of their own, or views of ``memory``, ``slot_bytes`` zeroed bytes on the host (the
    manager makes all of a model's slots in one mapping of huge pages, as the weights: ``tokenmill.host_memory``)."""

    def __init__(
        self,
        context: LoRAContext,
        in_features: int,
        part_sizes: tuple[int, ...],
        max_loras: int,
        max_lora_rank: int,
        dtype: torch.dtype,
        device: torch.device,
        memory: torch.Tensor | None = None,
    ) -> None:
        self.context = context
        self.max_lora_rank = max_lora_rank
        self.offsets = (0, *accumulate(part_sizes))[:-1]
        rank = max_lora_rank
        shapes = self._shapes(in_features, part_sizes, max_loras, rank)
        if memory is None:
            tensors = [torch.zeros(shape, dtype=dtype, device=device) for shape in shapes]
        else:
            sizes = [math.prod(shape) * dtype.itemsize for shape in shapes]
            tensors = [
                part.view(dtype).view(shape)
                for part, shape in zip(memory[: sum(sizes)].split(sizes), shapes, strict=True)
            ]
        self.lora_a = tensors[0]  # [max_loras, num_parts * max_lora_rank, in_features]
        self.lora_b = tensors[1:]  # each [max_loras, max_lora_rank, part_size]
        #: The kernels' ``add(batch, x, y)`` over these slots (``LoRAKernels.bind``).
        self.bound = context.kernels.bind(self.lora_a, self.lora_b, self.offsets)
        # Each slot's rows of each part, viewed once: loading an adapter is a few hundred small copies.
        self._slot_rows = [
            [(self.lora_a[slot, p * rank : (p + 1) * rank], b[slot]) for p, b in enumerate(self.lora_b)]
            for slot in range(max_loras)
        ]

    @staticmethod
    def _shapes(
        in_features: int, part_sizes: tuple[int, ...], max_loras: int, max_lora_rank: int
    ) -> list[tuple[int, ...]]:
        """``lora_a``'s shape, then each ``lora_b``'s."""
        rank = max_lora_rank
        return [(max_loras, len(part_sizes) * rank, in_features), *((max_loras, rank, size) for size in part_sizes)]

    @classmethod
    def slot_bytes(
        cls, in_features: int, part_sizes: tuple[int, ...], max_loras: int, max_lora_rank: int, dtype: torch.dtype
    ) -> int:
        """The bytes of one linear's slots (``memory``)."""
        shapes = cls._shapes(in_features, part_sizes, max_loras, max_lora_rank)
        return sum(math.prod(shape) for shape in shapes) * dtype.itemsize

    def stage(self, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
        """One part's adapter in this linear's slot layout, on the host: ``lora_a`` ``[r, in]`` and ``lora_b``
        ``[out, r]`` (any float dtype) become ``[r, in]`` and ``[r, out]`` in the slots' dtype, B scaled in
        float32 and transposed. Done while an adapter is read, so that ``load_slot`` is a plain copy."""
        dtype = self.lora_a.dtype
        staged_a = torch.empty(lora_a.shape, dtype=dtype)
        staged_a.copy_(lora_a)
        staged_b = torch.empty((lora_b.shape[1], lora_b.shape[0]), dtype=dtype)
        torch.mul(lora_b.to(torch.float32).T, scaling, out=staged_b)
        return staged_a, staged_b

    def load_slot(self, slot: int, parts: Mapping[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Put one adapter in ``slot``: for each part it adapts, ``parts[part]``, what ``stage`` made of it. What
        the adapter leaves (parts it does not adapt, ranks below ``max_lora_rank``) is zeroed, and nothing is
        written twice."""
        max_rank = self.max_lora_rank
        for part, (a_rows, b_rows) in enumerate(self._slot_rows[slot]):
            staged = parts.get(part)
            rank = 0 if staged is None else staged[0].shape[0]
            if staged is not None:
                (a_rows if rank == max_rank else a_rows[:rank]).copy_(staged[0])
                (b_rows if rank == max_rank else b_rows[:rank]).copy_(staged[1])
            if rank < max_rank:
                a_rows[rank:].zero_()
                b_rows[rank:].zero_()

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The base output ``y`` ``[num_tokens, out]`` of input ``x`` with each token's adapter added, in place."""
        batch = self.context.batch
        if batch is None:
            return y
        assert batch.num_tokens == x.shape[0], f"the step has {batch.num_tokens} tokens, the input {x.shape[0]}"
        self.bound(batch, x, y)
        return y
