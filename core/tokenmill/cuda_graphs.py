"""CUDA graphs for decode steps: one graph per batch-size bucket, captured at start-up, replayed per step.

A decode step (every request computes exactly one new token) launches the
same kernels with the same shapes step after step; on a GPU its cost at small
batch is mostly the CPU launching a few hundred small kernels. A CUDA graph
records those launches once and replays them with one call.

A graph replays fixed memory addresses and fixed host-side choices, so:

- The inputs live in static buffers (``DecodeGraphBuffers``): input ids,
  positions, slot mapping, sequence lengths, block tables padded to the most
  blocks a sequence can have (``ceil(max_model_len / block_size)``) and
  ``query_start_loc`` (``0..batch_size``: one token per request, constant).
  Each step's values are copied into them before the replay.
- A step of ``n`` requests replays the graph of the smallest captured batch
  size ``>= n`` (laid out by ``step_batch.pad_decode_batch``). Rows
  ``n..batch_size-1`` are padding requests: token 0 at position 0,
  ``seq_lens`` 1, block table ``[scratch_block, ...]``, so each writes its K/V
  into the scratch block (a KV block the KV cache manager never hands out) and
  attends to that one slot: finite values no real row reads.
- The attention metadata of a graph says ``max_query_len == 1`` and
  ``max_seq_len == max_model_len`` (a bound every replayed step meets), so a
  backend's host-side choices are fixed per bucket. Only backends with
  ``AttentionBackend.supports_cuda_graphs`` are captured; their ``prepare`` is
  captured together with the forward.
- Graphs are captured largest first into one shared memory pool, each after an
  eager warm-up run of its bucket (kernel compilation and lazily built tables
  happen there, not during capture). The graph computes the final hidden
  states; the model runner computes logits from the real rows eagerly.

Prefill and mixed steps, and batches larger than the largest bucket, run
eagerly. On CPU none of this exists: ``ModelRunner`` builds a
``CudaGraphRunner`` only on a CUDA device.

Figures: docs/benchmarks.md, "GPU: H200" and "GPU: H100".
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Iterable, Sequence
from operator import attrgetter

import torch
from torch import nn

from tokenmill.attention.backend import AttentionBackend, AttentionMetadata
from tokenmill.device_copy import pinned
from tokenmill.layers.moe import experts_read_on_the_host
from tokenmill.models.base import CausalLM
from tokenmill.step_batch import PaddedDecodeBatch, SequenceChunk, pad_decode_batch

logger = logging.getLogger(__name__)

__all__ = [
    "CudaGraphRunner",
    "DecodeGraphBuffers",
    "bucket_for",
    "capture_batch_sizes",
    "cuda_graph_batch_sizes",
]

_token_ids = attrgetter("token_ids")


# ---------------------------------------------------------------- choosing buckets


def capture_batch_sizes(batch_sizes: Iterable[int], max_num_seqs: int) -> tuple[int, ...]:
    """The batch sizes to capture: each capped at ``max_num_seqs`` (no step has more requests),
    sorted, deduplicated. ``(1, 2, 4, 8, 16)`` with ``max_num_seqs=6`` gives ``(1, 2, 4, 6)``.

    Called once at start-up by ``cuda_graph_batch_sizes``. Raises ``ValueError`` on a size below 1.
    """
    sizes = list(batch_sizes)
    bad = [size for size in sizes if size < 1]
    if bad:
        raise ValueError(f"device.cuda_graph_batch_sizes must be positive, got {bad[0]}")
    return tuple(sorted({min(size, max_num_seqs) for size in sizes}))


def cuda_graph_batch_sizes(
    enabled: bool,
    batch_sizes: Sequence[int],
    max_num_seqs: int,
    device: torch.device,
    backend: AttentionBackend,
    model: nn.Module,
) -> tuple[int, ...]:
    """The batch sizes ``ModelRunner`` should capture graphs for, or ``()`` for none.

    Called once at start-up by the engine. Graphs need all of: ``enabled``
    (``device.cuda_graphs``), a CUDA ``device``, a ``backend`` with
    ``supports_cuda_graphs`` and, in a mixture-of-experts ``model``, fused
    experts that run on the device alone (``FusedExperts.captures``); when one
    of the last two is missing, it logs why and how to get them.
    """
    if not enabled or device.type != "cuda":
        return ()
    if not type(backend).supports_cuda_graphs:
        logger.info(
            "CUDA graphs off: attention backend %r does not support capture (select --attention-backend triton)",
            getattr(backend, "name", type(backend).__name__),
        )
        return ()
    if (reason := experts_read_on_the_host(model)) is not None:
        logger.info("CUDA graphs off: %s (quantized experts, or select --fused-experts triton for dense ones)", reason)
        return ()
    return capture_batch_sizes(batch_sizes, max_num_seqs)


def bucket_for(num_reqs: int, batch_sizes: Sequence[int]) -> int | None:
    """The smallest of the sorted ``batch_sizes`` that holds ``num_reqs`` requests; None when none does.

    Called once per decode step by ``CudaGraphRunner.load_step``.
    """
    index = bisect.bisect_left(batch_sizes, num_reqs)
    return batch_sizes[index] if index < len(batch_sizes) and num_reqs > 0 else None


class DecodeGraphBuffers:
    """The static device tensors every decode graph reads, and the views one bucket sees.

    Built once at start-up by ``CudaGraphRunner``, holding padding rows only;
    ``load`` overwrites the front of them before each replay. Their addresses
    never change: the graphs recorded them.
    """

    def __init__(
        self, max_batch_size: int, max_blocks_per_seq: int, scratch_block: int, block_size: int, device: torch.device
    ) -> None:
        self.max_batch_size = max_batch_size
        self.max_blocks_per_seq = max_blocks_per_seq
        self.token_data = torch.zeros((3, max_batch_size), dtype=torch.int64, device=device)  # [3, max_batch_size]
        self.token_data[2] = scratch_block * block_size  # ids, positions, slots: all padding rows
        # One token per request: query_start_loc is 0..batch_size for every bucket, written once.
        self.query_start_loc = torch.arange(
            max_batch_size + 1, dtype=torch.int32, device=device
        )  # [max_batch_size + 1]
        self.seq_lens = torch.ones(max_batch_size, dtype=torch.int32, device=device)  # [max_batch_size]
        self.block_tables = torch.zeros(
            (max_batch_size, max_blocks_per_seq), dtype=torch.int32, device=device
        )  # [max_batch_size, max_blocks_per_seq]
        self.block_tables[:, 0] = scratch_block

    def load(self, padded: PaddedDecodeBatch) -> None:
        """Copy a padded step into the buffers' first ``padded.batch_size`` rows (three host-to-device
        copies). Columns of the block table past ``padded``'s width keep earlier values: valid block ids
        that no kernel reads, since each request's ``seq_lens`` ends before them.

        Called once per replayed step by ``CudaGraphRunner.load_step``, before the replay.
        """
        batch_size, width = padded.block_tables.shape
        assert batch_size <= self.max_batch_size and width <= self.max_blocks_per_seq
        device = self.token_data.device  # copies queued without waiting (tokenmill.device_copy)
        self.token_data[:, :batch_size].copy_(pinned(padded.token_data, device), non_blocking=True)
        self.seq_lens[:batch_size].copy_(pinned(padded.seq_lens, device), non_blocking=True)
        self.block_tables[:batch_size, :width].copy_(pinned(padded.block_tables, device), non_blocking=True)

    def input_ids(self, batch_size: int) -> torch.Tensor:
        """The first ``batch_size`` input ids [batch_size], a view."""
        return self.token_data[0, :batch_size]

    def metadata(self, batch_size: int, max_seq_len: int) -> AttentionMetadata:
        """Attention metadata over views of the buffers' first ``batch_size`` rows, decode-only.

        Called by ``CudaGraphRunner`` for each warm-up, capture and eager padded run.
        """
        return AttentionMetadata(
            positions=self.token_data[1, :batch_size],
            query_start_loc=self.query_start_loc[: batch_size + 1],
            seq_lens=self.seq_lens[:batch_size],
            block_tables=self.block_tables[:batch_size],
            slot_mapping=self.token_data[2, :batch_size],
            max_query_len=1,
            max_seq_len=max_seq_len,
        )


# ---------------------------------------------------------------- capture and replay


class CudaGraphRunner:
    """Captures a model's decode forward once per batch size and replays it.

    Built once at start-up by ``ModelRunner`` on a CUDA device, which then
    calls ``capture`` once and ``execute`` every step. It shares the runner's
    KV cache tensors; ``scratch_block`` must be a block of them that the KV
    cache manager never hands out.
    """

    def __init__(
        self,
        model: CausalLM,
        attention: AttentionBackend,
        kv_caches: list[torch.Tensor],
        block_size: int,
        max_model_len: int,
        batch_sizes: Sequence[int],
        scratch_block: int,
    ) -> None:
        assert batch_sizes and list(batch_sizes) == sorted(set(batch_sizes)), batch_sizes
        self.model = model
        self.attention = attention
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.batch_sizes = tuple(batch_sizes)
        self.scratch_block = scratch_block
        self.device = kv_caches[0].device
        self.buffers = DecodeGraphBuffers(
            self.batch_sizes[-1], -(-max_model_len // block_size), scratch_block, block_size, self.device
        )
        self.num_replays = 0  # steps served by a graph, for tests and stats
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}  # batch size -> its graph's hidden states [batch_size, hidden]

    @property
    def num_graphs(self) -> int:
        """Graphs captured so far: one per batch size after ``capture``."""
        return len(self._graphs)

    def forward_padded(self, batch_size: int) -> torch.Tensor:
        """Run ``prepare`` and the model eagerly over the buffers' first ``batch_size`` rows; returns the
        final hidden states [batch_size, hidden]. Called by ``capture`` for the warm-up and inside the
        capture, and by tests on any device."""
        metadata = self.buffers.metadata(batch_size, self.max_model_len)
        self.attention.prepare(metadata, self.block_size)
        return self.model(self.buffers.input_ids(batch_size), metadata.positions, self.kv_caches, metadata)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture one graph per batch size, largest first, into one memory pool. Called once at start-up
        by ``ModelRunner``, with the buffers holding padding rows only (the real KV blocks are untouched)."""
        assert self.device.type == "cuda", "CUDA graphs need a CUDA device"
        started = time.perf_counter()
        free_before, _ = torch.cuda.mem_get_info(self.device)
        pool = torch.cuda.graph_pool_handle()
        for batch_size in reversed(self.batch_sizes):
            self.forward_padded(batch_size)  # warm-up: compiles kernels, builds lazy tables outside the graph
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph, pool=pool):
                    self._outputs[batch_size] = self.forward_padded(batch_size)
            except RuntimeError as exc:
                raise RuntimeError(
                    f"capturing the decode CUDA graph for batch size {batch_size} failed ({exc}); a layer or the "
                    "attention backend is not graph-safe. Start with --no-cuda-graphs (device.cuda_graphs = false) "
                    "to run every step eagerly"
                ) from exc
            self._graphs[batch_size] = graph
        torch.cuda.synchronize(self.device)
        free_after, _ = torch.cuda.mem_get_info(self.device)
        logger.info(
            "captured %d CUDA graphs for decode batch sizes %s in %.2f s (about %.1f MiB of device memory)",
            self.num_graphs, list(self.batch_sizes), time.perf_counter() - started,
            (free_before - free_after) / 2**20,
        )  # fmt: skip

    def load_step(self, chunks: Sequence[SequenceChunk], input_ids: torch.Tensor | None = None) -> int | None:
        """If a graph can run this step, copy it into the buffers and return its batch size; else None
        (a prefill chunk, too many requests, a block table or sequence past ``max_model_len``).
        ``input_ids`` [len(chunks)] on the device replace the chunks' token ids (async scheduling).

        Called once per step by ``execute``.
        """
        batch_size = bucket_for(len(chunks), self.batch_sizes)
        if batch_size is None or set(map(len, map(_token_ids, chunks))) != {1}:
            return None
        padded = pad_decode_batch(chunks, batch_size, self.block_size, self.scratch_block)
        if padded.block_tables.shape[1] > self.buffers.max_blocks_per_seq or padded.max_seq_len > self.max_model_len:
            return None
        self.buffers.load(padded)
        if input_ids is not None:
            self.buffers.input_ids(len(chunks)).copy_(input_ids)
        return batch_size

    def execute(self, chunks: Sequence[SequenceChunk], input_ids: torch.Tensor | None = None) -> torch.Tensor | None:
        """Replay the step's graph; returns the real rows' final hidden states [len(chunks), hidden], a view
        of the graph's output that the next replay overwrites, or None when the step must run eagerly.
        ``input_ids``: as ``load_step``'s.

        Called once per step by ``ModelRunner.execute`` on a CUDA device, after ``capture``.
        """
        batch_size = self.load_step(chunks, input_ids)
        if batch_size is None:
            return None
        self._graphs[batch_size].replay()
        self.num_replays += 1
        return self._outputs[batch_size][: len(chunks)]
