"""The CPU paged-attention kernels against the torch reference backend, over a grid of shapes."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from tokenmill_kernels.paged_attention import cpu as kernels

from tests.cpu_machine import needs_cpu_kernels
from tokenmill.attention.backend import AttentionLayerSpec
from tokenmill.attention.kv_quant import is_quantized_kv, quantize_kv
from tokenmill.attention.torch_backend import TorchAttentionBackend
from tokenmill.model_runner import SequenceChunk, build_batch

pytestmark = needs_cpu_kernels

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


ISAS = ("avx2", "avx512")


@pytest.fixture(params=ISAS)
def isa(request):
    """Each kernel variant in turn (skipped where the CPU lacks it), restoring the default after."""
    if request.param not in kernels.supported_isas():
        pytest.skip(f"this CPU lacks {request.param} (it supports {', '.join(kernels.supported_isas())})")
    before = kernels.isa()
    kernels.set_isa(request.param)
    yield request.param
    kernels.set_isa(before)


@pytest.mark.parametrize("block_size", [1, 4, 16, 32])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"), [(4, 4, 32), (9, 3, 64), (8, 1, 128), (6, 2, 8), (5, 1, 40)]
)
@pytest.mark.parametrize("sliding_window", [None, 5])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16, torch.float8_e4m3fn, torch.int8])
def test_matches_reference_on_mixed_batches(
    block_size, num_heads, num_kv_heads, head_dim, sliding_window, cache_dtype, isa
):
    """fp8/int8 caches (codes and a scale per row): the kernel writes the same bytes as the torch reference
    backend and attends over them as it does, dequantizing on the fly. Every variant (``isa``): head_dim 40
    ends in a half register of the 512-bit one, 8 is nothing else."""
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
    rows = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=generator)
    cache = quantize_kv(rows, cache_dtype) if is_quantized_kv(cache_dtype) else rows.to(cache_dtype)
    spec = AttentionLayerSpec(num_heads, num_kv_heads, head_dim, head_dim**-0.5, sliding_window)

    reference_cache = cache.clone()
    reference = TorchAttentionBackend()
    reference.prepare(metadata, block_size)
    expected = reference.forward(spec, query, key, value, reference_cache, metadata)

    kernels.write_kv_cache(key, value, cache[0], cache[1], metadata.slot_mapping)
    # float16: rounded to nearest even, as torch's .to() does; fp8/int8: the same codes and scales
    assert torch.equal(cache.view(torch.uint8), reference_cache.view(torch.uint8))
    token_req = torch.repeat_interleave(torch.arange(len(query_lens), dtype=torch.int32), torch.tensor(query_lens))
    got = kernels.paged_attention(
        query, cache[0], cache[1], metadata.block_tables, token_req, metadata.positions, spec.scale, sliding_window
    )
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (5, 1, 40)])
@pytest.mark.parametrize("sliding_window", [None, 5])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
def test_soft_capped_scores_match_the_reference(block_size, num_heads, num_kv_heads, head_dim, sliding_window,
                                                cache_dtype, isa):  # fmt: skip
    """Gemma 2's attention: scores through cap * tanh(score / cap) before the softmax, a cap low enough (1.0, on
    scores of about N(0, 1) and up to 4) that it changes every weight."""
    query_lens, computed = [1, 1, 7, 5, 1], [0, 37, 0, 9, 16]
    num_blocks = 64
    _, metadata = _step(query_lens, computed, block_size, num_blocks, seed=block_size + head_dim)
    generator = torch.Generator().manual_seed(1)
    query = 2 * torch.randn(metadata.num_tokens, num_heads, head_dim, generator=generator)
    key = torch.randn(metadata.num_tokens, num_kv_heads, head_dim, generator=generator)
    value = torch.randn(metadata.num_tokens, num_kv_heads, head_dim, generator=generator)
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=generator).to(cache_dtype)
    spec = AttentionLayerSpec(num_heads, num_kv_heads, head_dim, head_dim**-0.5, sliding_window, logits_soft_cap=1.0)
    reference = TorchAttentionBackend()
    reference.prepare(metadata, block_size)
    expected = reference.forward(spec, query, key, value, cache.clone(), metadata)
    uncapped = reference.forward(dataclasses.replace(spec, logits_soft_cap=None), query, key, value, cache.clone(),
                                 metadata)  # fmt: skip
    assert (expected - uncapped).abs().max() > 0.1  # the cap matters
    kernels.write_kv_cache(key, value, cache[0], cache[1], metadata.slot_mapping)
    token_req = torch.repeat_interleave(torch.arange(len(query_lens), dtype=torch.int32), torch.tensor(query_lens))
    got = kernels.paged_attention(
        query, cache[0], cache[1], metadata.block_tables, token_req, metadata.positions, spec.scale, sliding_window,
        logits_soft_cap=spec.logits_soft_cap,
    )  # fmt: skip
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
def test_draft_trees_match_the_reference_backend(block_size, cache_dtype, isa):
    """Tree tokens skip their tree's other branches (64-bit masks), as the torch reference's masks do: a batch
    with a plain decode, a tree after recomputed tokens, a 64-node tree (every mask bit) and a prompt chunk."""
    wide = tuple([-1] * 8 + [j // 8 for j in range(56)])  # 64 nodes: 8 at depth 1, 7 children each
    chunks_spec = [
        (1, 23, None),
        (9, 40, (-1, -1, 0, 0, 1, 2, 5)),  # 2 recomputed tokens and the root, then 7 nodes
        (65, 12, wide),
        (6, 0, None),
    ]
    rng = random.Random(block_size)
    free = list(range(256))
    rng.shuffle(free)
    chunks = []
    for q_len, done, parents in chunks_spec:
        blocks = [free.pop() for _ in range(-(-(q_len + done) // block_size))]
        chunks.append(SequenceChunk(list(range(1, q_len + 1)), done, blocks, parents))
    _, metadata = build_batch(chunks, block_size)
    assert metadata.draft_tree is not None
    generator = torch.Generator().manual_seed(1)
    num_heads, num_kv_heads, head_dim = 6, 2, 32
    query = torch.randn(metadata.num_tokens, num_heads, head_dim, generator=generator)
    key = torch.randn(metadata.num_tokens, num_kv_heads, head_dim, generator=generator)
    value = torch.randn(metadata.num_tokens, num_kv_heads, head_dim, generator=generator)
    cache = torch.randn(2, 256, block_size, num_kv_heads, head_dim, generator=generator).to(cache_dtype)
    spec = AttentionLayerSpec(num_heads, num_kv_heads, head_dim, head_dim**-0.5)

    reference_cache = cache.clone()
    reference = TorchAttentionBackend()
    reference.prepare(metadata, block_size)
    expected = reference.forward(spec, query, key, value, reference_cache, metadata)

    from tokenmill_plugins.attention.cpu_backend import CpuAttentionBackend

    for max_kernel_query_len in (64, 128):  # the 65-token tree to SDPA under a mask; all through the kernel
        backend = CpuAttentionBackend()
        backend.max_kernel_query_len = max_kernel_query_len
        backend.prepare(metadata, block_size)
        got = backend.forward(spec, query, key, value, cache.clone(), metadata)
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("threads", [2, 4])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (8, 1, 128), (5, 1, 40)])
@pytest.mark.parametrize(("block_size", "sliding_window"), [(16, None), (1, None), (16, 2100)])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16, torch.int8])
def test_decode_keys_split_across_threads_match_the_reference(
    threads, num_heads, num_kv_heads, head_dim, block_size, sliding_window, cache_dtype, isa
):
    """A decode step of fewer (token, kv head) items than the threads can share evenly (3 here) over long
    contexts (parts of 512 keys or more) splits each item's keys into runs of spans and merges their softmax sums:
    the same result as the reference, and not bit for bit the single-threaded one (each item whole), which shows
    the split ran."""
    query_lens, computed = ([1], [2500]) if num_kv_heads == 3 else ([1, 1, 1], [2500, 2300, 2200])
    num_blocks = 7600 // block_size + 8
    _, metadata = _step(query_lens, computed, block_size, num_blocks, seed=block_size + head_dim)
    generator = torch.Generator().manual_seed(2)
    query = 3 * torch.randn(metadata.num_tokens, num_heads, head_dim, generator=generator)
    key = torch.randn(metadata.num_tokens, num_kv_heads, head_dim, generator=generator)
    value = torch.randn(metadata.num_tokens, num_kv_heads, head_dim, generator=generator)
    rows = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=generator)
    cache = quantize_kv(rows, cache_dtype) if is_quantized_kv(cache_dtype) else rows.to(cache_dtype)
    spec = AttentionLayerSpec(num_heads, num_kv_heads, head_dim, head_dim**-0.5, sliding_window)
    reference = TorchAttentionBackend()
    reference.prepare(metadata, block_size)
    expected = reference.forward(spec, query, key, value, cache.clone(), metadata)
    kernels.write_kv_cache(key, value, cache[0], cache[1], metadata.slot_mapping)
    token_req = torch.arange(len(query_lens), dtype=torch.int32)
    before = torch.get_num_threads()
    try:
        outputs = {}
        for n in (1, threads):
            torch.set_num_threads(n)
            outputs[n] = kernels.paged_attention(
                query, cache[0], cache[1], metadata.block_tables, token_req, metadata.positions, spec.scale,
                sliding_window,
            )  # fmt: skip
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(outputs[threads], expected, atol=ATOL, rtol=0)
    torch.testing.assert_close(outputs[1], expected, atol=ATOL, rtol=0)
    assert not torch.equal(outputs[threads], outputs[1])


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
    with pytest.raises(ValueError, match="float32, float16, float8_e4m3fn or int8"):
        kernels.paged_attention(query, *[torch.zeros(4, 16, 2, 64, dtype=torch.bfloat16)] * 2, *args, 0.1)
    with pytest.raises(ValueError, match="caches differ"):
        kernels.paged_attention(
            query, torch.zeros(4, 16, 2, 64), torch.zeros(4, 16, 2, 64, dtype=torch.float16), *args, 0.1
        )
    # a quantized cache's rows carry 4 bytes of scale: head_dim is the last dimension less 4
    with pytest.raises(ValueError, match="query head_dim 64 != cache head_dim 32"):
        kernels.paged_attention(query, *[torch.zeros(4, 16, 2, 36, dtype=torch.int8)] * 2, *args, 0.1)


def test_every_finite_fp8_code_reads_as_torch_converts_it():
    """The kernel widens e4m3 codes with a float16 bit trick (subnormals included): over one cached token,
    attention returns its value row, so each of the 254 finite codes must come back as torch reads it."""
    head_dim, scale = 64, 0.75
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]  # the two NaN codes are never written
    codes = torch.cat([codes, codes[:2]]).view(4, head_dim)  # 4 rows of 64 codes
    row = torch.cat([codes, torch.full((4, 1), scale).view(torch.uint8)], dim=1)  # codes, then the scale
    cache = torch.zeros(2, 4, 1, 1, head_dim + 4, dtype=torch.uint8)  # block_size 1, one kv head
    cache[:, :, 0, 0] = row
    cache = cache.view(torch.float8_e4m3fn)
    query = torch.zeros(4, 1, head_dim)
    got = kernels.paged_attention(
        query, cache[0], cache[1], torch.arange(4, dtype=torch.int32)[:, None], torch.arange(4, dtype=torch.int32),
        torch.zeros(4, dtype=torch.int64), 0.1,
    )  # fmt: skip
    expected = codes.view(torch.float8_e4m3fn).float() * scale
    assert torch.equal(got[:, 0], expected)


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.int8])
def test_quantized_write_rounds_every_midpoint_as_torch(cache_dtype):
    """The vectorized write against torch's conversions at their hardest inputs: rows whose absmax makes the scale
    exactly 1 carry every midpoint between adjacent codes (ties, rounded to even), a float32 ulp either side of
    each, and e4m3's subnormals and the boundary to its normals."""
    if cache_dtype == torch.float8_e4m3fn:
        codes = torch.arange(0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0 .. 448, ascending
        top = 448.0
    else:
        codes = torch.arange(128, dtype=torch.float32)
        top = 127.0
    midpoints = (codes[1:] + codes[:-1]) / 2  # exact in float32
    values = torch.cat([midpoints, midpoints.nextafter(torch.tensor(0.0)), midpoints.nextafter(torch.tensor(1e9))])
    values = torch.cat([values, -values, codes]).clamp(max=top)
    values = torch.cat([values, torch.zeros(-len(values) % 63)]).view(-1, 63)  # rows of 63, then the absmax
    key = torch.cat([values, torch.full((len(values), 1), top)], dim=1)[:, None, :]  # [rows, 1 kv head, 64]
    cache = torch.zeros(2, len(key), 1, 1, 68, dtype=cache_dtype)
    kernels.write_kv_cache(key, key, cache[0], cache[1], torch.arange(len(key)))
    expected = quantize_kv(key, cache_dtype).view(torch.uint8)
    assert torch.equal(cache[0, :, 0].view(torch.uint8), expected)
    assert torch.equal(cache[1, :, 0].view(torch.uint8), expected)


def test_set_isa_picks_the_best_for_auto_and_names_the_supported_ones():
    supported = kernels.supported_isas()
    before = kernels.isa()
    try:
        kernels.set_isa("auto")
        assert supported[0] == "avx2" and kernels.isa() == supported[-1]
        with pytest.raises(ValueError, match=f'supports \\({", ".join(supported)}\\), got "sse2"'):
            kernels.set_isa("sse2")
    finally:
        kernels.set_isa(before)
