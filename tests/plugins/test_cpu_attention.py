"""The ``cpu`` attention backend against the torch reference backend, on steps that use both of
its paths: the per-token kernel and SDPA for prompt chunks over ``max_kernel_query_len``."""

from __future__ import annotations

import random

import pytest
import torch
from tokenmill_kernels.paged_attention import cpu as kernels
from tokenmill_plugins.attention.cpu_backend import CpuAttentionBackend
from tokenmill_plugins.quant.weight_only import Int8Quantizer

from tests.factories import make_engine, run_to_completion, save_hf_model
from tokenmill.attention.backend import AttentionLayerSpec
from tokenmill.attention.kv_quant import is_quantized_kv, quantize_kv
from tokenmill.attention.torch_backend import TorchAttentionBackend
from tokenmill.engine import now
from tokenmill.messages import EngineCoreRequest
from tokenmill.model_runner import SequenceChunk, build_batch
from tokenmill.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not kernels.is_available(), reason="the CPU kernels need AVX2, FMA and a compiler")


@pytest.mark.parametrize("sliding_window", [None, 37])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(9, 3), (4, 4)])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float8_e4m3fn, torch.int8])
def test_mixed_step_with_long_chunks_matches_reference(sliding_window, num_heads, num_kv_heads, cache_dtype):
    """Both paths, the kernel and SDPA, read a float32 or quantized (fp8/int8) cache as the reference does."""
    block_size, num_blocks, head_dim = 16, 64, 64
    # decode, a 100-token chunk after 30 cached, a short chunk, a 70-token prompt from scratch
    query_lens, computed = [1, 100, 5, 70, 1], [40, 30, 12, 0, 200]
    rng = random.Random(0)
    free = list(range(num_blocks))
    rng.shuffle(free)
    chunks = [
        SequenceChunk([1] * q, done, [free.pop() for _ in range(-(-(q + done) // block_size))])
        for q, done in zip(query_lens, computed, strict=True)
    ]
    _, metadata = build_batch(chunks, block_size)
    generator = torch.Generator().manual_seed(1)
    query = torch.randn(metadata.num_tokens, num_heads, head_dim, generator=generator)
    key = torch.randn(metadata.num_tokens, num_kv_heads, head_dim, generator=generator)
    value = torch.randn(metadata.num_tokens, num_kv_heads, head_dim, generator=generator)
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=generator)
    if is_quantized_kv(cache_dtype):
        cache = quantize_kv(cache, cache_dtype)
    spec = AttentionLayerSpec(num_heads, num_kv_heads, head_dim, head_dim**-0.5, sliding_window)

    reference_cache = cache.clone()
    reference = TorchAttentionBackend()
    reference.prepare(metadata, block_size)
    expected = reference.forward(spec, query, key, value, reference_cache, metadata)

    backend = CpuAttentionBackend()
    backend.prepare(metadata, block_size)
    assert len(metadata.backend_state.long_chunks) == 2  # the 100- and 70-token chunks
    got = backend.forward(spec, query, key, value, cache, metadata)
    assert torch.equal(cache.view(torch.uint8), reference_cache.view(torch.uint8))
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=0)


@pytest.mark.parametrize(
    ("kv_cache_dtype", "stored"), [("auto", torch.float32), ("fp8", torch.float8_e4m3fn), ("int8", torch.int8)]
)
def test_engine_on_the_cpu_backend_matches_the_torch_backend(tmp_path, kv_cache_dtype, stored):
    save_hf_model("mistral-tiny", tmp_path)  # sliding window 8
    requests = [
        EngineCoreRequest(
            str(i),
            [(13 * i + 7 * t) % 500 + 1 for t in range(length)],
            SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
            [],
            now(),
        )
        for i, length in enumerate([3, 90, 17, 150])  # two prompts take the SDPA path
    ]
    cache = {"kv_cache_dtype": kv_cache_dtype}
    expected = run_to_completion(make_engine(tmp_path, attention={"backend": "torch"}, cache=cache), requests)
    engine = make_engine(tmp_path, attention={"backend": "cpu"}, cache=cache)
    assert engine.loaded.attention.name == "cpu"
    assert {kv_cache.dtype for kv_cache in engine.executor.runner.kv_caches} == {stored}
    assert run_to_completion(engine, requests) == expected


@pytest.mark.skipif(not Int8Quantizer.is_available(), reason="the quantized kernels need AVX2, FMA and a compiler")
def test_quantized_model_gets_a_float16_cache_read_alike_by_both_backends(tmp_path):
    """``kv_cache_dtype = "auto"`` stores float16 for a quantized float32 model; the kernel and SDPA
    paths read it as the torch reference backend does, so greedy tokens are equal."""
    save_hf_model("mistral-tiny", tmp_path)
    requests = [
        EngineCoreRequest(
            str(i),
            [(11 * i + 5 * t) % 500 + 1 for t in range(length)],
            SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
            [],
            now(),
        )  # fmt: skip
        for i, length in enumerate([4, 80, 21])  # the 80-token prompt takes the SDPA path
    ]
    engine = make_engine(tmp_path, model={"quantization": "int8"}, attention={"backend": "cpu"})
    assert engine.loaded.kv_cache_dtype == torch.float16
    assert {cache.dtype for cache in engine.executor.runner.kv_caches} == {torch.float16}
    reference = make_engine(
        tmp_path, model={"quantization": "int8"}, attention={"backend": "torch"}, cache={"kv_cache_dtype": "float16"}
    )
    assert run_to_completion(engine, requests) == run_to_completion(reference, requests)
    exact = make_engine(tmp_path, model={"quantization": "int8"}, cache={"kv_cache_dtype": "float32"})
    assert {cache.dtype for cache in exact.executor.runner.kv_caches} == {torch.float32}
