"""Running the model on one flattened batch over the paged KV cache.

The runner owns the KV cache tensors. Each step it receives, per request, the
new tokens to compute, how many of the request's tokens are already cached,
and its block table; it lays these out as one batch (``AttentionMetadata``),
runs the forward once and returns logits. On a CUDA device it may replay a
captured CUDA graph for decode steps instead (``tokenmill.cuda_graphs``).
Its inputs, ``SequenceChunk`` and the batch layouts, live in
``tokenmill.step_batch`` (re-exported here), below both this module and the graphs.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence

import torch

from tokenmill.attention.backend import AttentionMetadata
from tokenmill.cuda_graphs import CudaGraphRunner
from tokenmill.device_copy import to_device
from tokenmill.host_memory import anonymous_bytes
from tokenmill.model_loader import LoadedModel
from tokenmill.step_batch import SequenceChunk, build_batch

__all__ = ["ModelRunner", "SequenceChunk", "build_batch"]

logger = logging.getLogger(__name__)


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed tensor. Zeros matter: attention multiplies unused slots by a weight of 0, and uninitialised
    memory could hold NaN.

    On CPU the cache is a private anonymous mapping of its own, whose pages the OS maps, zeroed, as blocks are
    first written: a start costs no time for the pool's size (zeroing 4 GiB took 4-14 s on 2 cores), whatever
    memory the process freed before, which calloc would reuse and clear. The block pool hands out the blocks already
    used before untouched ones, so the resident part grows only with the load the cache has held;
    ``num_touched_blocks`` (the ``kv_cache_touched_bytes`` gauge) says how much, and ``bench soak`` counts RSS
    growth net of it. Huge pages are not asked for (unlike the weights, ``tokenmill.host_memory``): they made attention
    at 32 requests faster in ``bench step``, but not a server's throughput, even with their pages faulted in ahead
    by a thread, and its ITL p99 doubled (docs/benchmarks.md, "The KV pool in huge pages, measured again")."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    num_bytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return anonymous_bytes(num_bytes).view(dtype).view(shape)


class ModelRunner:
    """Owns the KV cache tensors and runs the model once per step. Built once per engine process.

    With ``cuda_graph_batch_sizes`` (only on a CUDA device; the engine picks them with
    ``cuda_graphs.cuda_graph_batch_sizes``), the cache gets one block more than
    ``num_blocks``, block ``num_blocks``, as the graphs' scratch block (the KV cache
    manager hands out ids below ``num_blocks`` only), and one decode graph per batch
    size is captured here, at construction.
    """

    def __init__(
        self,
        loaded: LoadedModel,
        num_blocks: int,
        block_size: int,
        cuda_graph_batch_sizes: Sequence[int] = (),
    ) -> None:
        self.loaded = loaded
        self.block_size = block_size
        self.num_blocks = num_blocks
        arch = loaded.arch
        num_cache_blocks = num_blocks + 1 if cuda_graph_batch_sizes else num_blocks
        shape = loaded.attention.kv_cache_shape(
            num_cache_blocks, block_size, loaded.num_kv_heads, arch.head_dim, loaded.kv_cache_dtype
        )  # a tensor-parallel shard caches its own KV heads only
        started = time.perf_counter()
        self.kv_caches = [
            _zeros(shape, loaded.kv_cache_dtype, loaded.device) for _ in range(arch.num_layers)
        ]  # each [2, num_cache_blocks, block_size, num_kv_heads, head_dim (+ 4 scale bytes if quantized)] by default
        logger.info(
            "KV cache allocated on %s: %.1f MiB in %.2f s",
            loaded.device, sum(c.nbytes for c in self.kv_caches) / 2**20, time.perf_counter() - started,
        )  # fmt: skip
        self.cuda_graphs: CudaGraphRunner | None = None
        if cuda_graph_batch_sizes:
            assert loaded.device.type == "cuda", "CUDA graphs are captured on a CUDA device only"
            self.cuda_graphs = CudaGraphRunner(
                loaded.model, loaded.attention, self.kv_caches, block_size, loaded.max_model_len,
                cuda_graph_batch_sizes, scratch_block=num_blocks,
            )  # fmt: skip
            self.cuda_graphs.capture()

    @torch.inference_mode()
    def warm_up(self) -> None:
        """One forward of one token into block 0 before the first request (the engine's ``load_runner`` calls it
        where no CUDA graph was captured): it waits for kernels still building on a first start (their plugins
        start the builds when selected, so they overlap the weights' loading) and takes first-call set-up out of
        the first request's latency. On rank 0 of a sharded model the workers run it too, as any step. Block 0's
        slot is garbage to the KV cache manager either way: a request's own tokens overwrite a slot before
        anything reads it."""
        started = time.perf_counter()
        self.execute([SequenceChunk([0], 0, [0])])
        logger.info("model warmed up in %.2f s", time.perf_counter() - started)

    @torch.inference_mode()
    def read_blocks(self, block_ids: list[int]) -> list[torch.Tensor]:
        """Copies of whole blocks, on the CPU, each [num_layers, 2, block_size, num_kv_heads, row] in the
        cache's dtype: what a KV tier stores (``row`` is head_dim, plus 4 bytes of scale in a quantized cache,
        so the scales travel with their codes). Needs the default cache layout (``kv_cache_shape``)."""
        index = torch.tensor(block_ids, device=self.loaded.device)
        stacked = torch.stack([kv_cache[:, index] for kv_cache in self.kv_caches])  # [layers, 2, n, block_size, ...]
        return list(stacked.permute(2, 0, 1, 3, 4, 5).to("cpu").unbind(0))

    @torch.inference_mode()
    def write_blocks(self, blocks: list[tuple[int, torch.Tensor]]) -> None:
        """Write whole blocks, as ``read_blocks`` returns them, into the cache (KV tier loads)."""
        index = torch.tensor([block_id for block_id, _ in blocks], device=self.loaded.device)
        data = torch.stack([b for _, b in blocks]).to(self.loaded.device)  # [n, layers, 2, block_size, ...]
        for layer, kv_cache in enumerate(self.kv_caches):
            kv_cache[:, index] = data[:, layer].transpose(0, 1).to(kv_cache.dtype)

    @torch.inference_mode()
    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: copy whole blocks (src -> dst) in every layer, before the step's forward."""
        if not copies:
            return
        src = to_device([c[0] for c in copies], self.loaded.device)
        dst = to_device([c[1] for c in copies], self.loaded.device)
        for kv_cache in self.kv_caches:
            kv_cache[:, dst] = kv_cache[:, src]

    def prepare_batch(self, chunks: Sequence[SequenceChunk]) -> tuple[torch.Tensor, AttentionMetadata]:
        """Lay ``chunks`` out as one batch on the device and let the attention backend prepare it:
        input ids [num_tokens] and the step's metadata, ready for the forward.

        Called by ``execute`` once per eagerly run step, and by ``bench step`` to time attention
        over a decode batch.
        """
        input_ids, metadata = build_batch(chunks, self.block_size, self.loaded.device)
        self.loaded.attention.prepare(metadata, self.block_size)
        return input_ids, metadata

    @torch.inference_mode()
    def execute(
        self,
        chunks: list[SequenceChunk],
        all_logits: bool = False,
        logits_indices: list[int] | None = None,
        input_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run one step. Returns float32 logits [num_rows, vocab]: by default of the last token of each
        chunk; with ``logits_indices``, of those tokens of the flattened batch (chunk after chunk: a
        prompt chunk that samples nothing needs none, a chunk verifying drafts needs several); with
        ``all_logits``, of every token.

        ``input_ids`` [len(chunks)] on the device, for a decode step scheduled while the step before still
        ran (async scheduling): each chunk's one token, in place of its token id (a placeholder).

        A decode step that fits a captured CUDA graph replays it; any other step runs eagerly. Nothing here
        waits for the device."""
        return self._logits(self._hidden(chunks, all_logits, logits_indices, input_ids))

    @torch.inference_mode()
    def execute_with_hidden(
        self, chunks: list[SequenceChunk], logits_indices: list[int] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``execute``, also returning the final hidden states of the same rows [num_rows, hidden] (what
        Medusa heads read)."""
        hidden = self._hidden(chunks, False, logits_indices)
        return self._logits(hidden), hidden

    def _hidden(
        self,
        chunks: list[SequenceChunk],
        all_logits: bool,
        logits_indices: list[int] | None,
        device_input_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The final hidden states of the rows ``execute`` returns logits for."""
        if self.cuda_graphs is not None:
            hidden = self.cuda_graphs.execute(chunks, device_input_ids)  # [num_reqs, hidden]: one token per request
            if hidden is not None:
                if logits_indices is not None and not all_logits and logits_indices != list(range(len(chunks))):
                    hidden = hidden[to_device(logits_indices, hidden.device)]
                return hidden
        input_ids, metadata = self.prepare_batch(chunks)
        if device_input_ids is not None:
            assert input_ids.shape == device_input_ids.shape, "device input ids are for decode steps"
            input_ids = device_input_ids
        tree = metadata.draft_tree
        positions = metadata.positions if tree is None else tree.rotary_positions
        hidden = self.loaded.model(input_ids, positions, self.kv_caches, metadata)
        if all_logits:
            return hidden
        if logits_indices is None:
            rows = metadata.query_start_loc[1:].long() - 1  # [num_reqs]: each chunk's last token
        else:
            rows = to_device(logits_indices, hidden.device)  # [num_rows]
        return hidden[rows]

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if hidden.shape[0] == 0:
            return hidden.new_empty((0, self.loaded.arch.vocab_size), dtype=torch.float32)
        return self.loaded.model.compute_logits(hidden)
