"""A step's requests laid out as one batch of model inputs.

The engine hands the model runner one ``SequenceChunk`` per scheduled request.
Two layouts are built from them, both vectorised with numpy (the only
per-request work is reading each chunk's lists once, in C, with
``numpy.fromiter`` over ``itertools.chain``; no Python statement runs per
request):

- ``build_batch``: every new token flattened into one batch, with its
  ``AttentionMetadata`` (the eager forward, ``model_runner``);
- ``pad_decode_batch``: a decode step (one token per request) padded to a
  captured batch size, on the host (the CUDA graphs, ``cuda_graphs``).

This module sits below both users, so neither imports the other for its inputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from operator import attrgetter

import numpy
import torch

from tokenmill.attention.backend import AttentionMetadata, DraftTreeMask
from tokenmill.device_copy import to_device
from tokenmill.speculative.draft_tree import depths, is_chain, path

__all__ = ["PaddedDecodeBatch", "SequenceChunk", "build_batch", "pad_decode_batch"]


@dataclass(frozen=True)
class SequenceChunk:
    """One request's share of a step."""

    token_ids: list[int]  # the new tokens to compute this step
    num_computed_tokens: int  # tokens of this request already in the cache
    block_ids: list[int]  # the request's block table; must cover every token after this step
    #: When the last ``len(draft_parents)`` tokens are drafts forming a tree rather than a chain: each one's
    #: parent among them (-1: the token before them), as ``tokenmill.speculative.draft_tree`` defines it.
    draft_parents: tuple[int, ...] | None = None


_token_ids = attrgetter("token_ids")
_num_computed = attrgetter("num_computed_tokens")
_block_ids = attrgetter("block_ids")
_draft_parents = attrgetter("draft_parents")


def _lengths(chunks: Sequence[SequenceChunk], get_list: attrgetter[list[int]]) -> numpy.ndarray:
    """The length of each chunk's ``get_list`` [num_reqs] int64."""
    return numpy.fromiter(map(len, map(get_list, chunks)), numpy.int64, len(chunks))


def _check_capacity(num_blocks: numpy.ndarray, seq_lens: numpy.ndarray, block_size: int) -> None:
    """Raise ``ValueError`` for the first request whose block table cannot hold its tokens after the step."""
    too_short = numpy.flatnonzero(num_blocks * block_size < seq_lens)
    if too_short.size:
        i = int(too_short[0])
        raise ValueError(f"block table of {num_blocks[i]} blocks cannot hold {seq_lens[i]} tokens")


def _block_tables(
    chunks: Sequence[SequenceChunk], num_blocks: numpy.ndarray, num_rows: int, width: int
) -> numpy.ndarray:
    """Every chunk's block table scattered into one zero-padded table [num_rows, width] int32, in one
    indexed assignment; rows past ``len(chunks)`` stay zero."""
    total_blocks = int(num_blocks.sum())
    flat_blocks = numpy.fromiter(chain.from_iterable(map(_block_ids, chunks)), numpy.int32, total_blocks)
    block_start = numpy.cumsum(num_blocks) - num_blocks  # [num_reqs]
    block_req = numpy.repeat(numpy.arange(len(chunks)), num_blocks)  # [total_blocks]
    block_tables = numpy.zeros((num_rows, width), dtype=numpy.int32)  # [num_rows, width]
    block_tables[block_req, numpy.arange(total_blocks) - block_start[block_req]] = flat_blocks
    return block_tables


def _slot_mapping(
    block_tables: numpy.ndarray, token_req: numpy.ndarray, positions: numpy.ndarray, block_size: int
) -> numpy.ndarray:
    """The KV cache slot of each token [num_tokens] int64: its block's id * block_size + its offset in it."""
    token_blocks = block_tables[token_req, positions // block_size].astype(numpy.int64)  # [num_tokens]
    return token_blocks * block_size + positions % block_size


def build_batch(
    chunks: Sequence[SequenceChunk], block_size: int, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, AttentionMetadata]:
    """Flatten ``chunks`` into input ids [num_tokens] and the step's attention metadata on ``device``.

    Called once per eagerly run step by ``ModelRunner.execute``. Raises ``ValueError`` when a block
    table cannot hold its request's tokens.
    """
    num_reqs = len(chunks)
    query_lens = _lengths(chunks, _token_ids)  # [num_reqs]
    computed = numpy.fromiter(map(_num_computed, chunks), numpy.int64, num_reqs)  # [num_reqs]
    num_blocks = _lengths(chunks, _block_ids)  # [num_reqs]
    seq_lens = computed + query_lens  # [num_reqs]
    _check_capacity(num_blocks, seq_lens, block_size)

    query_start_loc = numpy.zeros(num_reqs + 1, dtype=numpy.int64)  # [num_reqs + 1]
    numpy.cumsum(query_lens, out=query_start_loc[1:])
    num_tokens = int(query_start_loc[-1])
    token_req = numpy.repeat(numpy.arange(num_reqs), query_lens)  # [num_tokens]
    positions = numpy.arange(num_tokens) - query_start_loc[token_req] + computed[token_req]  # [num_tokens]
    block_tables = _block_tables(chunks, num_blocks, num_reqs, int(num_blocks.max()))  # [num_reqs, max_blocks]
    slot_mapping = _slot_mapping(block_tables, token_req, positions, block_size)  # [num_tokens]
    input_ids = numpy.fromiter(chain.from_iterable(map(_token_ids, chunks)), numpy.int64, num_tokens)

    metadata = AttentionMetadata(
        positions=to_device(positions, device),
        query_start_loc=to_device(query_start_loc.astype(numpy.int32), device),
        seq_lens=to_device(seq_lens.astype(numpy.int32), device),
        block_tables=to_device(block_tables, device),
        slot_mapping=to_device(slot_mapping, device),
        max_query_len=int(query_lens.max()),
        max_seq_len=int(seq_lens.max()),
        draft_tree=_draft_tree_mask(chunks, query_start_loc, positions, device),
    )
    return to_device(input_ids, device), metadata


def _draft_tree_mask(
    chunks: Sequence[SequenceChunk],
    query_start_loc: numpy.ndarray,
    positions: numpy.ndarray,
    device: torch.device | str,
) -> DraftTreeMask | None:
    """The step's draft trees as ``AttentionMetadata.draft_tree``; None when no chunk verifies a tree (a chain
    of drafts is plain causal attention). A Python loop over the tree chunks only: trees are drafted where a
    step holds few requests."""
    if not any(map(_draft_parents, chunks)):  # in C, as the rest of a step's layout: most steps have no drafts
        return None
    trees = [(i, c.draft_parents) for i, c in enumerate(chunks) if c.draft_parents and not is_chain(c.draft_parents)]
    if not trees:
        return None
    width = max(len(parents) for _, parents in trees)
    rotary_positions = positions.copy()  # [num_tokens]
    token_index: list[int] = []
    tree_start: list[int] = []
    visible: list[numpy.ndarray] = []
    for i, parents in trees:
        end = int(query_start_loc[i + 1])
        first = end - len(parents)  # the flattened index of node 0
        start = int(positions[first])
        rotary_positions[first:end] = start - 1 + numpy.asarray(depths(parents))  # the root is at start - 1
        rows = numpy.zeros((len(parents), width), dtype=bool)  # [num_nodes, width]
        for node in range(len(parents)):
            rows[node, path(parents, node)] = True
        token_index.extend(range(first, end))
        tree_start.extend([start] * len(parents))
        visible.append(rows)
    return DraftTreeMask(
        token_index=to_device(numpy.asarray(token_index, dtype=numpy.int64), device),
        tree_start=to_device(numpy.asarray(tree_start, dtype=numpy.int64), device),
        visible=to_device(numpy.concatenate(visible), device),
        rotary_positions=to_device(rotary_positions, device),
    )


@dataclass(frozen=True)
class PaddedDecodeBatch:
    """One decode step laid out for a graph of ``batch_size`` rows, on the host (numpy)."""

    num_reqs: int  # real rows; rows num_reqs.. are padding
    token_data: numpy.ndarray  # [3, batch_size] int64: input ids, positions, slot mapping
    seq_lens: numpy.ndarray  # [batch_size] int32
    block_tables: numpy.ndarray  # [batch_size, max(1, most blocks of any request)] int32
    max_seq_len: int  # of the real rows

    @property
    def batch_size(self) -> int:
        return int(self.seq_lens.shape[0])


def pad_decode_batch(
    chunks: Sequence[SequenceChunk], batch_size: int, block_size: int, scratch_block: int
) -> PaddedDecodeBatch:
    """Lay out a decode step (each chunk has exactly one token) as ``batch_size`` rows, padded.

    Padding rows hold token 0 at position 0 with ``seq_lens`` 1 and the block table
    ``[scratch_block, 0, ...]``, so their slot is the first of ``scratch_block``.
    Called once per decode step by ``CudaGraphRunner.load_step``; raises
    ``ValueError`` when a block table cannot hold its request's tokens.
    """
    num_reqs = len(chunks)
    assert 0 < num_reqs <= batch_size, f"{num_reqs} requests do not fit a graph of {batch_size}"
    computed = numpy.fromiter(map(_num_computed, chunks), numpy.int64, num_reqs)  # [num_reqs]: the new positions
    num_blocks = _lengths(chunks, _block_ids)  # [num_reqs]
    seq_lens = computed + 1  # [num_reqs]
    _check_capacity(num_blocks, seq_lens, block_size)

    width = max(int(num_blocks.max()), 1)
    block_tables = _block_tables(chunks, num_blocks, batch_size, width)  # [batch_size, width]
    block_tables[num_reqs:, 0] = scratch_block

    token_data = numpy.zeros((3, batch_size), dtype=numpy.int64)  # [3, batch_size]: ids, positions, slots
    token_data[0, :num_reqs] = numpy.fromiter(chain.from_iterable(map(_token_ids, chunks)), numpy.int64, num_reqs)
    token_data[1, :num_reqs] = computed
    token_data[2, :num_reqs] = _slot_mapping(block_tables, numpy.arange(num_reqs), computed, block_size)
    token_data[2, num_reqs:] = scratch_block * block_size
    padded_seq_lens = numpy.ones(batch_size, dtype=numpy.int32)  # [batch_size]
    padded_seq_lens[:num_reqs] = seq_lens
    return PaddedDecodeBatch(num_reqs, token_data, padded_seq_lens, block_tables, int(seq_lens.max()))
