"""The CPU paged-attention kernels against the torch reference backend, over a grid of shapes."""

from __future__ import annotations

import random

import pytest
import torch
from tokenmill_kernels.paged_attention import cpu as kernels

from tokenmill.attention.backend import AttentionLayerSpec
from tokenmill.attention.torch_backend import TorchAttentionBackend
from tokenmill.model_runner import SequenceChunk, build_batch

pytestmark = pytest.mark.skipif(not kernels.is_available(), reason="the CPU kernels need AVX2, FMA and a compiler")

# float32 arithmetic throughout (a float16 cache is widened as it is read, by the reference too);
# the kernel sums in another order than SDPA, so results agree to rounding.
ATOL = 2e-5


def _step(query_lens: list[int], computed: list[int], block_size: int, num_blocks: int, seed: int):
    """A batch whose requests own shuffled, interleaved blocks."""
    rng = random.Random(seed)
    free = list(range(num_blocks))
    rng.shuffle(free)
    chunks = []
    for q_len, done in zip(query_lens, computed, strict=True):
        needed = -(-(q_len + done) // block_size)
        chunks.append(SequenceChunk([1] * q_len, done, [free.pop() for _ in range(needed)]))
    return build_batch(chunks, block_size)


@pytest.mark.parametrize("block_size", [1, 4, 16, 32])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(4, 4, 32), (9, 3, 64), (8, 1, 128), (6, 2, 8)])
@pytest.mark.parametrize("sliding_window", [None, 5])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
def test_matches_reference_on_mixed_batches(block_size, num_heads, num_kv_heads, head_dim, sliding_window, cache_dtype):
    # decode tokens, a prompt from scratch, a chunk continuing a prompt, a one-token prompt
    query_lens, computed = [1, 1, 7, 5, 1, 1], [0, 37, 0, 9, 0, 16]
    num_blocks = 96  # enough for every request even with block_size 1
    _, metadata = _step(query_lens, computed, block_size, num_blocks, seed=block_size + head_dim)
    generator = torch.Generator().manual_seed(0)
    num_tokens = metadata.num_tokens
    query = torch.randn(num_tokens, num_heads, head_dim, generator=generator)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator)
    # Earlier tokens' K/V already in the cache: random, so every cached position matters.
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=generator).to(cache_dtype)
    spec = AttentionLayerSpec(num_heads, num_kv_heads, head_dim, head_dim**-0.5, sliding_window)

    reference_cache = cache.clone()
    reference = TorchAttentionBackend()
    reference.prepare(metadata, block_size)
    expected = reference.forward(spec, query, key, value, reference_cache, metadata)

    kernels.write_kv_cache(key, value, cache[0], cache[1], metadata.slot_mapping)
    assert torch.equal(cache, reference_cache)  # float16: rounded to nearest even, as torch's .to() does
    token_req = torch.repeat_interleave(torch.arange(len(query_lens), dtype=torch.int32), torch.tensor(query_lens))
    got = kernels.paged_attention(
        query, cache[0], cache[1], metadata.block_tables, token_req, metadata.positions, spec.scale, sliding_window
    )
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


def test_rejects_bad_shapes():
    cache = torch.zeros(4, 16, 2, 64)
    query = torch.zeros(3, 5, 64)  # 5 heads cannot share 2 kv heads
    with pytest.raises(ValueError, match="cannot share"):
        kernels.paged_attention(
            query, cache, cache, torch.zeros(1, 4, dtype=torch.int32), torch.zeros(3, dtype=torch.int32),
            torch.zeros(3, dtype=torch.int64), 0.1,
        )  # fmt: skip
    with pytest.raises(ValueError, match="head_dim"):
        kernels.paged_attention(
            torch.zeros(3, 4, 60), torch.zeros(4, 16, 2, 60), torch.zeros(4, 16, 2, 60),
            torch.zeros(1, 4, dtype=torch.int32), torch.zeros(3, dtype=torch.int32),
            torch.zeros(3, dtype=torch.int64), 0.1,
        )  # fmt: skip


def test_rejects_caches_it_cannot_read():
    args = (torch.zeros(1, 4, dtype=torch.int32), torch.zeros(3, dtype=torch.int32), torch.zeros(3, dtype=torch.int64))
    query = torch.zeros(3, 4, 64)
    with pytest.raises(ValueError, match="float32 or float16"):
        kernels.paged_attention(query, *[torch.zeros(4, 16, 2, 64, dtype=torch.bfloat16)] * 2, *args, 0.1)
    with pytest.raises(ValueError, match="caches differ"):
        kernels.paged_attention(
            query, torch.zeros(4, 16, 2, 64), torch.zeros(4, 16, 2, 64, dtype=torch.float16), *args, 0.1
        )
