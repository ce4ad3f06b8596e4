"""Attention over a paged KV cache: the interface; the torch reference lives in ``torch_backend``."""

from tokenmill.attention.backend import AttentionBackend, AttentionLayerSpec, AttentionMetadata

__all__ = ["AttentionBackend", "AttentionLayerSpec", "AttentionMetadata"]
