"""The ``triton`` attention backend: Triton kernels over the paged KV cache.

Each layer's forward launches three kernels at most: the cache write, decode
attention (requests with one new token) and prefill attention (prompt chunks;
skipped in a decode-only step). ``prepare`` builds the only per-step index
table (the prefill tiles) once per step on the device, so ``forward`` launches
kernels over tensors in ``metadata`` and ``backend_state`` and never waits on
the device: the shape a CUDA graph needs. Its two host-side choices are fixed
in a captured decode graph (``supports_cuda_graphs``): the prefill launch is
skipped (``max_query_len == 1``) and the split count comes from the graph's
batch size and ``max_seq_len``, which the model runner sets to the context
window when it captures.

Runs on CUDA GPUs, and on CPU under the Triton interpreter
(``TRITON_INTERPRET=1``; slow: meant for tests and CI). Triton is a GPU extra: the
kernels are imported when a backend is built, so that this module imports, and
"auto" passes it over quietly, on a CPU install without Triton.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from typing import ClassVar

import torch

from tokenmill import AttentionBackend, AttentionLayerSpec, AttentionMetadata, PluginError
from tokenmill_plugins.triton_import import import_triton_kernels

logger = logging.getLogger(__name__)

_CPU_NEEDS_INTERPRETER = (
    "the 'triton' attention backend runs on CPU only under the Triton interpreter: set TRITON_INTERPRET=1 "
    "in the environment before starting tokenmill (slow: for tests), or select the built-in backend with "
    "--attention-backend torch"
)


@dataclass
class TritonStepState:
    """What ``prepare`` computes once per step for every layer."""

    block_size: int
    #: ``(tile_req, tile_start)`` from ``build_prefill_tiles``; None in a decode-only step.
    prefill_tiles: tuple[torch.Tensor, torch.Tensor] | None


class TritonAttentionBackend(AttentionBackend):
    """Paged attention with the Triton kernels of ``tokenmill_kernels.paged_attention.triton``.

    Built once per engine process by the model loader. On a machine without
    CUDA it refuses to be built unless the kernels run under the interpreter.
    """

    name: ClassVar[str] = "triton"
    #: "cpu" only under TRITON_INTERPRET=1 (checked at construction and in ``prepare``).
    supported_devices: ClassVar[tuple[str, ...]] = ("cuda", "cpu")
    #: For ``attention.backend = "auto"``: above ``torch`` (0) and ``cpu`` (10). ``is_available`` is false
    #: without CUDA, so this only matters on a GPU, where the kernels were run and timed (docs/benchmarks.md,
    #: "GPU: H200" and "GPU: H100").
    auto_priority: ClassVar[int] = 20
    #: Decode graphs: ``prepare`` does no device work when ``max_query_len == 1``, ``forward`` reads no
    #: device value on the host, its buffers come from torch's allocator, and the split count depends only
    #: on the batch size and ``max_seq_len`` (the context window at capture; a slice past a request's
    #: ``seq_len`` is empty and weighs 0 in the merge). Not yet run on a GPU.
    supports_cuda_graphs: ClassVar[bool] = True
    #: Quantized caches (``fp8``, ``int8``: codes and a float32 scale per token and KV head, the format of
    #: ``tokenmill.attention.kv_quant``): the write quantizes, attention dequantizes each tile as it loads it.
    #: Otherwise the cache is in the model's dtype.
    kv_cache_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float8_e4m3fn, torch.int8)

    #: The kernels' ``SUPPORTED_HEAD_DIMS`` (not imported here: importing them imports Triton).
    head_dims: ClassVar[tuple[int, ...] | None] = (32, 64, 128, 256)

    @classmethod
    def is_available(cls) -> bool:
        """Whether "auto" may pick it: a CUDA device is visible and Triton is installed (the CPU
        interpreter is opt-in, by name)."""
        return torch.cuda.is_available() and importlib.util.find_spec("triton") is not None

    @classmethod
    def auto_selectable(cls, device: torch.device, head_dim: int) -> bool:
        """On CUDA only: on the CPU it runs under the interpreter, and only when asked for by name."""
        return device.type == "cuda" and super().auto_selectable(device, head_dim)

    def __init__(self) -> None:
        self._kernels = import_triton_kernels(
            "tokenmill_kernels.paged_attention.triton",
            "the 'triton' attention backend",
            "select another backend with --attention-backend",
        )
        self._is_interpreted = self._kernels.is_interpreted()
        if not torch.cuda.is_available() and not self._is_interpreted:
            raise PluginError(f"no CUDA device found: {_CPU_NEEDS_INTERPRETER}")
        self._num_sms: dict[int, int] = {}  # device index -> multiprocessor count, for split-K decode

    def prepare(self, metadata: AttentionMetadata, block_size: int) -> None:
        """Build the step's prefill tile table on the device. Called once per step by the model runner."""
        if metadata.positions.device.type == "cpu" and not self._is_interpreted:
            raise PluginError(_CPU_NEEDS_INTERPRETER)
        prefill_tiles = None
        if metadata.max_query_len > 1:
            prefill_tiles = self._kernels.build_prefill_tiles(metadata.query_start_loc, metadata.num_tokens)
        metadata.backend_state = TritonStepState(block_size=block_size, prefill_tiles=prefill_tiles)

    def forward(
        self,
        layer: AttentionLayerSpec,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim (+ 4 when quantized)]
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Write this step's K/V, then attend. Called once per layer per step; launches kernels only."""
        state: TritonStepState = metadata.backend_state
        assert kv_cache.shape[2] == state.block_size, "the cache's block size differs from the one prepared"
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        self._kernels.write_kv_cache(key, value, key_cache, value_cache, metadata.slot_mapping)
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)  # [num_tokens, num_heads, head_dim]
        self._decode(layer, query, key_cache, value_cache, metadata, out)
        if state.prefill_tiles is not None:
            self._kernels.paged_attention_prefill(
                query, key_cache, value_cache, metadata.block_tables, metadata.seq_lens,
                metadata.query_start_loc, metadata.positions, *state.prefill_tiles, out,
                scale=layer.scale, sliding_window=layer.sliding_window,
            )  # fmt: skip
        return out

    def _decode(
        self,
        layer: AttentionLayerSpec,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        value_cache: torch.Tensor,
        metadata: AttentionMetadata,
        out: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    ) -> None:
        """Decode attention into ``out`` for requests with one new token; the CUDA backend overrides this."""
        self._kernels.paged_attention_decode(
            query, key_cache, value_cache, metadata.block_tables, metadata.seq_lens,
            metadata.query_start_loc, metadata.positions, out,
            scale=layer.scale, sliding_window=layer.sliding_window,
            num_splits=self._num_splits(query.device, metadata, layer.num_kv_heads),
        )  # fmt: skip

    def _num_splits(self, device: torch.device, metadata: AttentionMetadata, num_kv_heads: int) -> int:
        """Split-K for long contexts at small batch on a GPU; from host integers only (no device sync).
        In a captured decode graph these are the graph's batch size and the context window."""
        if device.type != "cuda":
            return 1  # the interpreter gains nothing from more programs
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in self._num_sms:
            self._num_sms[index] = torch.cuda.get_device_properties(index).multi_processor_count
        return self._kernels.choose_num_splits(
            metadata.num_reqs, num_kv_heads, metadata.max_seq_len, self._num_sms[index]
        )
