"""The attention-backend interface: attention over a paged KV cache.

The model runner flattens every scheduled request of a step into one batch:
each request contributes ``query_len`` new tokens (a prompt chunk, or one
decode token) whose K/V are written into cache slots, and whose queries attend
to all of that request's tokens so far, read through its block table. Prefill,
chunked prefill and decode of different requests are therefore one call.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from tokenmill.attention.kv_quant import kv_row_size


@dataclass
class DraftTreeMask:
    """The tokens of a step that verify a draft tree (``tokenmill.speculative.draft_tree``), for the attention mask.

    A tree's nodes sit in consecutive cache slots after the request's last token, node ``j`` at position
    ``tree_start + j`` of the request's sequence (``AttentionMetadata.positions`` counts slots, as for any other
    token), but several nodes are candidates for the same place in the text. So a tree token attends causally
    as usual, except to the keys of its tree's other branches: of positions ``tree_start ..
    tree_start + num_nodes - 1`` it sees only those that ``visible`` marks (itself and its ancestors).
    """

    token_index: torch.Tensor  # [num_tree_tokens] int64: where the tree tokens are among the step's tokens
    tree_start: torch.Tensor  # [num_tree_tokens] int64: position of the first node of each one's tree
    visible: torch.Tensor  # [num_tree_tokens, max_num_nodes] bool: [t, j] whether token t sees node j of its tree
    #: [num_tokens] int64: every token's position in the text, for the rotary embedding: a tree node's is its
    #: root's plus its depth; other tokens' equal ``positions``.
    rotary_positions: torch.Tensor


def tree_visibility(tree_start: torch.Tensor, visible: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
    """[num_tree_tokens, len(key_positions)] bool: whether each tree token may see the key at each position as
    far as the tree goes (keys before its tree: yes; its tree's nodes: ``visible``), for tree tokens given by
    ``DraftTreeMask.tree_start`` and ``.visible`` (or rows of them). The causal mask still applies on top:
    positions after a token stay hidden."""
    offset = key_positions[None, :] - tree_start[:, None]  # [num_tree_tokens, num_keys]
    in_tree = (offset >= 0) & (offset < visible.shape[1])
    seen = visible.gather(1, offset.clamp(0, visible.shape[1] - 1))
    return ~in_tree | seen


@dataclass
class AttentionMetadata:
    """One step's batch layout, shared by every layer. Built by the model runner each step."""

    positions: torch.Tensor  # [num_tokens] int64: position of each new token in its sequence
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32: request i's tokens are [start[i], start[i+1])
    seq_lens: torch.Tensor  # [num_reqs] int32: tokens of request i in the cache after this step
    block_tables: torch.Tensor  # [num_reqs, max_num_blocks] int32: request i's block ids, in order
    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot (block_id * block_size + offset) per token
    max_query_len: int
    #: The longest ``seq_lens`` entry; in a step replayed from a CUDA graph, an upper bound (the context
    #: window), fixed when the graph was captured.
    max_seq_len: int
    #: Tokens verifying draft trees and what they may not see; None in a step without trees. Only a backend
    #: with ``supports_draft_trees`` gets a step that has one.
    draft_tree: DraftTreeMask | None = None
    #: Whatever the backend's ``prepare`` computed for this step (masks, gather indices, ...).
    backend_state: Any = field(default=None, repr=False)

    @property
    def num_reqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]


@dataclass(frozen=True)
class AttentionLayerSpec:
    """What differs between attention layers of one model."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    sliding_window: int | None = None  # attend to at most this many latest tokens (incl. itself)
    #: Scores (after ``scale``) pass through ``cap * tanh(score / cap)`` before the softmax (Gemma 2); only
    #: backends with ``supports_logits_soft_cap`` take a layer that sets it.
    logits_soft_cap: float | None = None


class AttentionBackend(ABC):
    """Computes attention for all requests of a step over a paged KV cache.

    Built once per engine process, with no arguments. ``prepare`` runs once
    per step in the engine process before the model's forward; ``forward``
    runs once per layer per step. Neither may call hooks, block, or keep
    references to a step's tensors after the step.
    """

    #: Registered name.
    name: ClassVar[str]
    #: Devices this backend runs on.
    supported_devices: ClassVar[tuple[str, ...]] = ("cpu", "cuda")
    #: ``attention.backend = "auto"`` picks, among the available backends that run on the
    #: device, the one with the highest priority.
    auto_priority: ClassVar[int] = 0
    #: Whether the model runner may capture decode steps in CUDA graphs with this backend (see
    #: ``tokenmill.cuda_graphs``). ``True`` promises that, for metadata with ``max_query_len == 1``
    #: and ``max_seq_len`` equal to the context window, ``prepare`` and ``forward`` together:
    #: read no device value on the host (no ``.item()``, ``.tolist()``, ``.cpu()``, nonzero or other
    #: data-dependent shapes); allocate only through torch's caching allocator; take every host-side
    #: decision (kernel choice, grid, split count) from tensor shapes and those two integers alone; and
    #: read metadata tensors only where a request's ``seq_lens`` reaches (block-table entries past a
    #: request's blocks are stale but valid block ids). Both are then captured once per batch size at
    #: start-up, after a warm-up run, and replayed with new values in the same tensors; neither is called
    #: for a replayed step. Rows past the step's requests are padding requests: one token at position 0,
    #: ``seq_lens`` 1, written to and read from a scratch block that no request owns.
    supports_cuda_graphs: ClassVar[bool] = False
    #: Storage dtypes, besides the model's own, that ``forward`` accepts for ``kv_cache``
    #: (``cache.kv_cache_dtype``): it converts new keys and values as it writes them and widens
    #: what it reads, computing in the query's dtype. Empty: the cache is in the model's dtype.
    #: ``torch.float8_e4m3fn`` and ``torch.int8`` are the quantized formats of
    #: ``tokenmill.attention.kv_quant`` (codes plus a float32 scale per token and KV head).
    kv_cache_dtypes: ClassVar[tuple[torch.dtype, ...]] = ()

    #: Whether ``prepare`` and ``forward`` apply ``metadata.draft_tree`` (tree tokens see only their own
    #: branch of the tree). Speculators draft chains with a backend without it.
    supports_draft_trees: ClassVar[bool] = False

    #: Whether ``forward`` applies ``AttentionLayerSpec.logits_soft_cap``. The model loader picks, and
    #: accepts by name, only backends with it for a model whose attention caps its scores (Gemma 2).
    supports_logits_soft_cap: ClassVar[bool] = False

    #: Head sizes ``forward`` takes; None: any. ``attention.backend = "auto"`` passes over a backend
    #: that does not take the model's ``head_dim``.
    head_dims: ClassVar[tuple[int, ...] | None] = None

    @classmethod
    def is_available(cls) -> bool:
        """Whether this machine can run it (CPU features, compiler, GPU libraries). Called at
        start-up by ``attention.backend = "auto"``; must be cheap and must not raise."""
        return True

    @classmethod
    def auto_selectable(cls, device: torch.device, head_dim: int) -> bool:
        """Whether ``attention.backend = "auto"`` may pick it for a model of ``head_dim`` on ``device``.
        The default: ``device`` is one of ``supported_devices``, ``head_dim`` one of ``head_dims`` and
        ``is_available()``. A backend that runs somewhere only when asked by name narrows it."""
        return (
            device.type in cls.supported_devices
            and (cls.head_dims is None or head_dim in cls.head_dims)
            and cls.is_available()
        )

    def kv_cache_shape(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype | None = None
    ) -> tuple[int, ...]:
        """Shape of one layer's KV cache tensor of ``dtype`` (the cache's storage dtype; None: a float
        one). Called once at start-up.

        The default is ``[2, num_blocks, block_size, num_kv_heads, head_dim]``
        (keys then values); for a quantized ``dtype`` each row holds its scale too,
        ``head_dim + 4`` codes (``tokenmill.attention.kv_quant``). A backend with another
        layout overrides this and ``forward`` together.
        """
        return (2, num_blocks, block_size, num_kv_heads, kv_row_size(head_dim, dtype or torch.float32))

    def prepare(self, metadata: AttentionMetadata, block_size: int) -> None:
        """Precompute what every layer of this step shares into ``metadata.backend_state``.

        Called once per step, before the forward. The default does nothing. In a
        step replayed from a CUDA graph it runs only at capture, inside the graph
        (see ``supports_cuda_graphs``): device work here is replayed, host work is not.
        """

    @abstractmethod
    def forward(
        self,
        layer: AttentionLayerSpec,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # this layer's cache, shaped by kv_cache_shape
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Write the new tokens' K/V into their slots, then attend; returns [num_tokens, num_heads, head_dim].

        Each query attends causally to its own request's cached tokens at
        positions ``<= its position`` (and within ``layer.sliding_window``).
        Called once per layer per step in the engine process.
        """
