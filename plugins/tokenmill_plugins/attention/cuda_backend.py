"""The ``cuda`` attention backend: a CUDA decode kernel launched through CuPy, Triton for the rest.

The CUDA kernel (``tokenmill_kernels.paged_attention.cuda``) computes decode
attention only. The rest comes from the Triton backend this one extends: the
cache write, and the Triton prefill kernel for the prompt chunks of a step
that has any. So this backend needs a CUDA GPU, CuPy and Triton.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from tokenmill_kernels.paged_attention import cuda as cuda_kernels

from tokenmill import AttentionLayerSpec, AttentionMetadata, PluginError
from tokenmill_plugins.attention.triton_backend import TritonAttentionBackend


class CudaAttentionBackend(TritonAttentionBackend):
    """Decode attention with the CUDA kernel of ``kernels/paged_attention/cuda/decode.cu``; prefill chunks
    with the Triton prefill kernel, and the cache write with the Triton write kernel.

    Built once per engine process by the model loader; refuses to be built
    without a CUDA device or without CuPy, naming what is missing.
    """

    name: ClassVar[str] = "cuda"
    supported_devices: ClassVar[tuple[str, ...]] = ("cuda",)
    #: Below ``triton``'s: the CUDA kernel passes its tests on an H200 but was not timed against Triton's.
    auto_priority: ClassVar[int] = -1
    #: Not inherited from ``triton``: capturing the CuPy launch in a CUDA graph is untested.
    supports_cuda_graphs: ClassVar[bool] = False
    #: Not inherited from ``triton`` either: the CUDA decode kernel reads caches in the model's dtype only.
    kv_cache_dtypes: ClassVar[tuple[torch.dtype, ...]] = ()

    @classmethod
    def is_available(cls) -> bool:
        """Whether "auto" may pick it: CUDA is visible, and Triton and CuPy are installed."""
        return super().is_available() and cuda_kernels.unavailable_reason() is None

    def __init__(self) -> None:
        reason = cuda_kernels.unavailable_reason()
        if reason is not None:
            raise PluginError(
                f"the 'cuda' attention backend cannot run here: {reason}; "
                "select --attention-backend triton or torch instead"
            )
        super().__init__()

    def prepare(self, metadata: AttentionMetadata, block_size: int) -> None:
        """Build the step's prefill tile table on the device. Called once per step by the model runner."""
        if metadata.positions.device.type != "cuda":
            raise PluginError(f"the 'cuda' attention backend needs CUDA tensors, got {metadata.positions.device}")
        super().prepare(metadata, block_size)

    def _decode(
        self,
        layer: AttentionLayerSpec,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        value_cache: torch.Tensor,
        metadata: AttentionMetadata,
        out: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    ) -> None:
        """Decode attention into ``out`` with the CUDA kernel. Called by ``forward`` once per layer per step."""
        cuda_kernels.paged_attention_decode_cuda(
            query, key_cache, value_cache, metadata.block_tables, metadata.seq_lens,
            metadata.query_start_loc, metadata.positions, out,
            scale=layer.scale, sliding_window=layer.sliding_window,
        )  # fmt: skip
