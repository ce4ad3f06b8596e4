"""The plugin's own tests: run from the package folder once it is installed."""

import subprocess

import torch
from tokenmill_eager_attention.backend import EagerAttentionBackend

from tokenmill import AttentionLayerSpec
from tokenmill.attention.torch_backend import TorchAttentionBackend
from tokenmill.model_runner import SequenceChunk, build_batch


def test_listed_by_tokenmill_plugins():
    listing = subprocess.run(["tokenmill", "plugins"], capture_output=True, text=True, check=True).stdout
    assert "eager-attention 0.1.0 (entry point)" in listing
    assert "attention_backend: eager" in listing


def test_matches_the_builtin_backend():
    """Same cache, same batch: the eager and the SDPA backend agree."""
    torch.manual_seed(0)
    spec = AttentionLayerSpec(num_heads=4, num_kv_heads=2, head_dim=8, scale=8**-0.5, sliding_window=5)
    # A 6-token chunk after 3 cached tokens, and a decode token after 9, blocks out of order.
    chunks = [SequenceChunk([1] * 6, 3, [2, 0, 5]), SequenceChunk([1], 9, [1, 3, 4])]
    _, metadata = build_batch(chunks, block_size=4)
    q = torch.randn(7, 4, 8)
    k, v = torch.randn(7, 2, 8), torch.randn(7, 2, 8)
    outputs = []
    for backend in (EagerAttentionBackend(), TorchAttentionBackend()):
        torch.manual_seed(1)
        cache = torch.randn(2, 6, 4, 2, 8)
        backend.prepare(metadata, 4)
        outputs.append(backend.forward(spec, q, k, v, cache, metadata))
    torch.testing.assert_close(outputs[0], outputs[1], atol=1e-5, rtol=1e-5)
