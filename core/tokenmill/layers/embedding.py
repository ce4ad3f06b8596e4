"""``VocabParallelEmbedding``: the token embedding, its rows split over the tensor-parallel shards."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers.kernels import UsesLayerKernels
from tokenmill.parallel.group import TensorParallelGroup


class VocabParallelEmbedding(UsesLayerKernels):
    """Rank r holds rows ``[r * vocab / N, (r + 1) * vocab / N)`` of the embedding; a token's vector comes
    from the rank holding its row, the others contribute zeros, and one all-reduce sums them. With one
    shard it is a plain embedding lookup. A tied output projection reads the same rows as its weight, so
    each rank computes the logits of its part of the vocabulary (with the model's layer kernels' dense matmul,
    where they bring one: ``UsesLayerKernels``)."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype, group: TensorParallelGroup) -> None:
        super().__init__()
        self.group = group
        self.vocab_start, self.vocab_end = group.shard_range(vocab_size)
        num_rows = self.vocab_end - self.vocab_start
        self.weight = nn.Parameter(torch.empty(num_rows, hidden_size, dtype=dtype), requires_grad=False)

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a checkpoint's whole embedding ``[vocab, hidden]`` (at load; a ``ValueError``
        when its shape does not fit)."""
        expected = [self.weight.shape[0] * self.group.size, self.weight.shape[1]]
        if list(tensor.shape) != expected:
            raise ValueError(f"has shape {list(tensor.shape)}, expected {expected}")
        return tensor[self.vocab_start : self.vocab_end]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.group.size == 1:
            return F.embedding(input_ids, self.weight)
        local_ids = input_ids - self.vocab_start  # [num_tokens]
        is_here = (local_ids >= 0) & (local_ids < self.weight.shape[0])  # [num_tokens]
        embedded = F.embedding(local_ids.masked_fill(~is_here, 0), self.weight)  # [num_tokens, hidden]
        embedded.masked_fill_(~is_here[:, None], 0.0)
        return self.group.all_reduce(embedded)
